"""A Llama too large for plain PyTorch on one GPU's budget, trained through strata from weights on disk: built
with empty weights, its random bf16 weights written as sharded safetensors, streamed in with weights=, the
optimizer states homed in host memory (NVMe for what the host cannot hold), M micro-batches a step.

    python3 benchmarks/large_bench.py --dir DIR [--device cuda|emulated] [--layers 32] [--hidden 4096]
        [--heads 32] [--intermediate 11008] [--vocab 32000] [--seq 2048] [--batch 4] [--micro-batches 8]
        [--steps 4] [--host-memory auto|SIZE] [--host-reserve SIZE] [--overlap SIZE] [--peak-tflops 989]
        [--json OUT]

The defaults are a 7B Llama (6.74B parameters). The weights go to DIR/weights (kept: a second run on the same
machine reuses them when their index matches the model), the NVMe tier to DIR/nvme. Reported: the seconds to
write and to load the weights, seconds a step (the median after the first two steps), tokens/s, model TFLOPS
(6 N + 12 L h s a token) and MFU against --peak-tflops, the plan's predicted step, bytes a step over each link,
and the budgets with how they were planned (plan_budgets).

A step is M micro-batches of --batch x --seq tokens (engine.train_step, standard order): the CPU update of every
parameter runs once a step, so M sets how much compute it is spread over.
"""

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time

import torch

import strata
from strata._strata import parse_size

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_bench import WARMUP_STEPS, synchronize  # noqa: E402

GiB = 2**30
STATE_BYTES_PER_PARAM = 16  # bf16 param and grad, fp32 master, exp_avg and exp_avg_sq: every chunk has a home
AUTO_HOST_EXTRA = 1 / 8     # the host tier's room for pieces beyond its homes (host.budget auto's eighth)
INIT_STD = 0.02             # the weights' spread (Llama's initializer_range)
POOL_ELEMS = 1 << 26        # random values drawn once (128 MiB of bf16) that every tensor is cut from


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="where the weights (DIR/weights) and the NVMe tier (DIR/nvme) go")
    p.add_argument("--device", choices=["emulated", "cuda"], default="cuda")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="sequences a micro-batch")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches a step")
    p.add_argument("--steps", type=int, default=4, help=f"steps; the first {WARMUP_STEPS} are not timed")
    p.add_argument("--shard-size", default="2GiB", help="bytes a safetensors shard")
    p.add_argument("--host-memory", default="auto", help="host memory to plan for (auto: MemAvailable now)")
    p.add_argument("--host-reserve", default="16GiB",
                   help="host memory left to the rest of the process (Python, torch, CUDA, the stream ring, the "
                        "page cache the weights are read through); the overlap copies are reserved beside it")
    p.add_argument("--device-budget", default="auto", help="device.budget (auto: half the GPU's free memory)")
    p.add_argument("--overlap", default="0", help="optimizer.overlap: host bytes for overlapped updates "
                   "(each a copy of its group's 16 bytes a parameter: every GiB of it a GiB of states off the host)")
    p.add_argument("--link-gbps", type=float, default=25.0, help="the emulated device's links, GB/s")
    p.add_argument("--peak-tflops", type=float, help="the device's peak, for MFU (default: none)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.steps <= WARMUP_STEPS:
        p.error(f"--steps {args.steps}: more than the {WARMUP_STEPS} warm-up steps, so that some are timed")
    return args


def llama_config(args):
    import transformers
    return transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                    intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                    num_attention_heads=args.heads, num_key_value_heads=args.heads,
                                    max_position_embeddings=args.seq, initializer_range=INIT_STD,
                                    tie_word_embeddings=False)


def empty_model(args):
    """The model on the meta device but its buffers (accelerate's init_empty_weights keeps those real, as
    strata needs for the rotary frequencies, which no weights file holds)."""
    import accelerate
    import transformers
    with accelerate.init_empty_weights():
        model = transformers.LlamaForCausalLM(llama_config(args))
    model.tie_weights()
    return model


def memory_available_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("large_bench: /proc/meminfo has no MemAvailable: give --host-memory")


def plan_budgets(parameters, host_memory_bytes, reserve_bytes, overlap_bytes):
    """host.budget for a model of `parameters` trained in bf16: every chunk (16 bytes a parameter) is homed on
    the host or NVMe, params and grads first (Note [Homes] in memory/placement.cc), so the host tier takes what
    the machine's memory leaves beside the reserve and the overlap copies, at most what host.budget auto would
    give every chunk (their bytes and an eighth); the optimizer states beyond it are homed on NVMe."""
    homes = STATE_BYTES_PER_PARAM * parameters
    wanted = int(homes * (1 + AUTO_HOST_EXTRA))
    room = host_memory_bytes - reserve_bytes - overlap_bytes
    if room <= 4 * parameters:
        raise ValueError(f"large_bench: {host_memory_bytes / GiB:.1f} GiB of host memory less "
                         f"{(reserve_bytes + overlap_bytes) / GiB:.1f} GiB reserved leaves no room for the "
                         f"parameters and gradients ({4 * parameters / GiB:.1f} GiB): give more --host-memory or "
                         "less --host-reserve / --overlap")
    host_budget = min(wanted, room)
    return {"homes_bytes": homes, "host_memory_bytes": host_memory_bytes, "reserve_bytes": reserve_bytes,
            "overlap_bytes": overlap_bytes, "host_budget_bytes": host_budget,
            "states_on_nvme_bytes": max(0, homes - host_budget)}


def weight_shapes(model):
    """(name, shape) of every parameter, in model order: what the weights file holds."""
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def random_tensor(shape, name, pool, generator):
    """A bf16 tensor of `shape`, cut from `pool` at random offsets (drawing every value afresh costs minutes at
    7B on one core); norms' weights are ones, as the model's own init gives."""
    numel = math.prod(shape)
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    out = torch.empty(numel, dtype=torch.bfloat16)
    at = 0
    while at < numel:
        start = int(torch.randint(0, pool.numel(), (1,), generator=generator))
        take = min(numel - at, pool.numel() - start)
        out[at:at + take] = pool[start:start + take]
        at += take
    return out.view(shape)


def write_weights(model, directory, shard_bytes, seed=0):
    """The model's parameters as random bf16 safetensors shards in `directory` with save_pretrained's index,
    one shard in memory at a time; returns the bytes written. An index that already lists these tensors with
    these shapes is kept (its shards are reused)."""
    from safetensors.torch import save_file
    shapes = weight_shapes(model)
    index_path = os.path.join(directory, "model.safetensors.index.json")
    signature = {name: list(shape) for name, shape in shapes}
    total = sum(2 * math.prod(shape) for _, shape in shapes)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            index = json.load(f)
        shards = set(index["weight_map"].values())
        if index["metadata"].get("shapes") == signature and all(
                os.path.isfile(os.path.join(directory, s)) for s in shards):
            return 0
    os.makedirs(directory, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    pool = (torch.randn(POOL_ELEMS, generator=generator) * INIT_STD).to(torch.bfloat16)
    groups, group, size = [], [], 0
    for name, shape in shapes:
        nbytes = 2 * math.prod(shape)
        if group and size + nbytes > shard_bytes:
            groups.append(group)
            group, size = [], 0
        group.append((name, shape))
        size += nbytes
    groups.append(group)
    weight_map = {}
    for number, group in enumerate(groups, 1):
        shard = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: random_tensor(shape, name, pool, generator) for name, shape in group}
        save_file(tensors, os.path.join(directory, shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in tensors})
        del tensors
    with open(index_path, "w") as f:
        json.dump({"metadata": {"total_size": total, "shapes": signature}, "weight_map": weight_map}, f)
    return total


def strata_config(args, budgets, nvme_dir):
    config = {"precision": "bf16",
              "optimizer": {"type": "adamw", "lr": 1e-5, "weight_decay": 0.01,
                            "overlap": budgets["overlap_bytes"]},
              "device": {"backend": args.device},
              "host": {"budget": budgets["host_budget_bytes"]},
              "nvme": {"dirs": [nvme_dir]},
              "log": {"level": "error"}}
    if args.device_budget != "auto":
        config["device"]["budget"] = parse_size(args.device_budget)
    if args.device == "emulated":
        config["device"]["emulated_bandwidth_gbps"] = args.link_gbps
    return config


def model_flops_per_token(args, parameters):
    return 6 * parameters + 12 * args.layers * args.hidden * args.seq


def train(args, engine, model, device, parameters):
    """Seconds of each timed step and of its step phase (after the last backward: last_step's seconds), and
    the stats' link bytes over them."""
    generator = torch.Generator().manual_seed(1)

    def loss_fn(module, tokens):
        return module(input_ids=tokens, labels=tokens).loss

    seconds, phases, before = [], [], {}
    for number in range(args.steps):
        if number == WARMUP_STEPS:
            before = {link: v["bytes"] for link, v in engine.stats()["links"].items()}
        micro_batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator).to(device)
                         for _ in range(args.micro_batches)]
        synchronize(device)
        start = time.perf_counter()
        losses = engine.train_step(micro_batches, loss_fn, accumulation="standard")
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        phases.append(engine.last_step.get("seconds"))
        print(f"step {number}: {seconds[-1]:.3f} s, loss {losses.float().mean().item():.4f}", flush=True)
    timed = seconds[WARMUP_STEPS:]
    links = {link: (v["bytes"] - before.get(link, 0)) / len(timed) for link, v in engine.stats()["links"].items()}
    return timed, phases[WARMUP_STEPS:], links


def run(args):
    device = torch.device("cuda") if args.device == "cuda" else torch.device("cpu")
    model = empty_model(args)
    parameters = sum(p.numel() for p in model.parameters())
    weights_dir = os.path.join(args.dir, "weights")
    nvme_dir = os.path.join(args.dir, "nvme")
    os.makedirs(nvme_dir, exist_ok=True)
    host_memory = memory_available_bytes() if args.host_memory == "auto" else parse_size(args.host_memory)
    budgets = plan_budgets(parameters, host_memory, parse_size(args.host_reserve), parse_size(args.overlap))
    start = time.perf_counter()
    written = write_weights(model, weights_dir, parse_size(args.shard_size))
    write_s = time.perf_counter() - start
    print(f"{parameters / 1e9:.2f}B parameters; weights {'written' if written else 'reused'} "
          f"({write_s:.1f} s); host {host_memory / GiB:.1f} GiB: host.budget "
          f"{budgets['host_budget_bytes'] / GiB:.1f} GiB for {budgets['homes_bytes'] / GiB:.1f} GiB of homes, "
          f"about {budgets['states_on_nvme_bytes'] / GiB:.1f} GiB of states on NVMe", flush=True)
    start = time.perf_counter()
    engine = strata.initialize(model, strata_config(args, budgets, nvme_dir), weights=weights_dir)
    load_s = time.perf_counter() - start
    print(f"initialize with weights=: {load_s:.1f} s", flush=True)
    timed, phases, links = train(args, engine, model, device, parameters)
    stats = engine.stats()
    seconds = statistics.median(timed)
    tokens = args.micro_batches * args.batch * args.seq
    tflops = tokens * model_flops_per_token(args, parameters) / seconds / 1e12
    result = {
        "parameters": parameters, "tokens_per_step": tokens, "write_weights_s": write_s,
        "weights_bytes_written": written, "initialize_s": load_s, "s_per_step": seconds, "steps_s": timed,
        "step_phase_s": statistics.median(phases) if None not in phases else None,
        "tokens_per_s": tokens / seconds, "model_tflops": tflops,
        "mfu": tflops / args.peak_tflops if args.peak_tflops else None,
        "predicted_step_s": stats["pipeline"].get("plan", {}).get("predicted_step_seconds"),
        "stall_fraction": stats["pipeline"].get("stall_fraction"),
        "overlap_groups": stats["last_step"].get("overlap_groups"),
        "bytes_per_step": links, "budgets": budgets,
        "tiers": {tier: usage["capacity_bytes"] for tier, usage in stats["tiers"].items()}}
    engine.close()
    del engine, model
    gc.collect()
    return result


def print_result(args, r):
    mfu = "-" if r["mfu"] is None else f"{r['mfu']:.3f}"
    plan = "-" if r["predicted_step_s"] is None else f"{r['predicted_step_s']:.3f}"
    links = ", ".join(f"{link} {b / 1e9:.2f}GB" for link, b in r["bytes_per_step"].items() if b)
    print(f"llama: {r['parameters'] / 1e9:.2f}B parameters ({args.layers} layers of {args.hidden}), "
          f"{args.micro_batches} x {args.batch} x {args.seq} tokens a step, bf16, device {args.device}")
    print(f"{'s/step':>9}{'step':>8}{'tokens/s':>11}{'TFLOPS':>9}{'MFU':>7}{'plan s':>9}{'stall':>7}"
          f"{'write s':>9}{'load s':>8}  bytes/step by link")
    stall = "-" if r["stall_fraction"] is None else f"{r['stall_fraction']:.2f}"
    phase = "-" if r["step_phase_s"] is None else f"{r['step_phase_s']:.3f}"
    print(f"{r['s_per_step']:>9.3f}{phase:>8}{r['tokens_per_s']:>11.0f}{r['model_tflops']:>9.1f}{mfu:>7}"
          f"{plan:>9}{stall:>7}{r['write_weights_s']:>9.1f}{r['initialize_s']:>8.1f}  {links}")


def main(argv=None):
    args = parse_args(argv)
    result = run(args)
    print_result(args, result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "result": result}, f, indent=1)


if __name__ == "__main__":
    main()
