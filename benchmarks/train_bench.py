"""The main job's speed: a model trained in plain PyTorch and through strata in the three configurations of
issue 24, with where each step's time goes.

    python3 benchmarks/train_bench.py [--device emulated|cuda] [--model gpt|llama] [--layers 4] [--hidden 256]
        [--heads 4] [--seq 128] [--batch 8] [--steps 6] [--precision fp32|bf16] [--link-gbps 25]
        [--peak-tflops X] [--backward-to-update R] [--json OUT]

The configurations, by the device budget against the model states (16 bytes a parameter):
- fits: twice the model states (nothing needs to move);
- streamed: a third of them, the host twice them (parameters streamed, CPU Adam);
- nvme: a sixth, the host a third, the rest on NVMe (a directory under --nvme-dir);
- and +overlap: the same with optimizer.overlap (each group's CPU update begun in backward, its copy kept in
  host memory the size of the model states).

For each run: seconds a step (the median after the first two steps), forward / backward / step phases,
tokens/s, model TFLOPS (6 N + 12 L h s a token) and MFU against --peak-tflops, the adapter's host
synchronizations a step (engine.stats()'s), the pipeline's stall fraction and the bytes a step over each link.
The phases are timed with the device synchronized at their ends (on CUDA; the benchmark's own waits, not
counted among strata's). On the emulated device the links run at --link-gbps; compute is the CPU's.

The emulated device computes on the host's cores, so its backward is far longer against the CPU update than a
GPU's (on an H200, a 0.94B Llama's backward is about half its CPU update; on two cores, this module's default
Llama's is 10 to 15 times it). --backward-to-update R scales the emulated device's compute to a GPU's: the
tokens a step (--seq, at --batch) are chosen so that plain PyTorch's backward takes about R times the whole
model's update at `strata bench optim`'s rate, each guess measured and the sequence length refitted (three
tries at most; the ratio reached is printed and recorded). Every run then trains at that length.

And where the step phase goes (a second table): last_step's phases (means over the timed steps), against the
step's parts: its updates at the rate `strata bench optim` measures for as many parameters on this machine in
the same run (--strata-bin), plus the bytes the step phase moved at --link-gbps (emulated device); the kernel's
rate inside the step against that rate; and the step phase against the whole model's update at that rate
(with optimizer.overlap, what is left of the update after backward).
"""

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import strata
from strata._strata import parse_size

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))
from gpt import GPT  # noqa: E402

CONFIGS = {  # (device budget, host budget) as fractions of the model states; host None: the default
    "fits": (2.0, None),
    "streamed": (1 / 3, 2.0),
    "streamed+overlap": (1 / 3, 2.0),
    "nvme": (1 / 6, 1 / 3),
    "nvme+overlap": (1 / 6, 1 / 3),
}
WARMUP_STEPS = 2  # the trace, then the first plan
STRATA_BIN = os.path.join(os.path.dirname(strata.__file__), "..", "..", "bin", "strata")  # build/python -> build/bin
LEAST = re.compile(r"raise (device|host)\.budget to at least ([0-9.]+ ?[KMGT]?i?B)")


def add_model_args(p, layers, batch, steps):
    """The model's and the run's flags (build_model's), with these defaults."""
    p.add_argument("--device", choices=["emulated", "cuda"], default="emulated")
    p.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=batch, help="sequences a (micro-)batch")
    p.add_argument("--steps", type=int, default=steps, help=f"steps a run; the first {WARMUP_STEPS} are not timed")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, layers=4, batch=8, steps=6)
    p.add_argument("--configs", default=",".join(CONFIGS), help="which of " + ", ".join(CONFIGS))
    p.add_argument("--link-gbps", type=float, default=25.0, help="the emulated device's links, GB/s")
    p.add_argument("--peak-tflops", type=float, help="the device's peak, for MFU (default: none)")
    p.add_argument("--backward-to-update", type=float, metavar="R",
                   help="emulated device: scale its compute (the tokens a step) so that plain backward takes about "
                        "R times the CPU update (the module docstring; default: --seq as given)")
    p.add_argument("--nvme-dir", help="where the nvme run's states go (default: a temporary directory)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--strata-bin", default=STRATA_BIN,
                   help="the strata CLI, for `strata bench optim`'s rate (default: the build's; none: not measured)")
    args = p.parse_args(argv)
    if args.steps <= WARMUP_STEPS:
        p.error(f"--steps {args.steps}: more than the {WARMUP_STEPS} warm-up steps, so that some are timed")
    if args.backward_to_update is not None:
        if args.device != "emulated":
            p.error(f"--backward-to-update scales the emulated device's compute; --device is {args.device}, whose "
                    "compute is its own")
        if not args.backward_to_update > 0:
            p.error(f"--backward-to-update {args.backward_to_update}: give a ratio > 0, e.g. 0.55 (an H200's)")
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        p.error(f"--configs: {', '.join(sorted(unknown))} unknown; give some of {', '.join(CONFIGS)}")
    return args


def build_model(args):
    torch.manual_seed(0)
    if args.model == "llama":
        import transformers
        config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                          intermediate_size=int(args.hidden * 8 / 3) // 64 * 64 or 64,
                                          num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                          max_position_embeddings=args.seq)
        return transformers.LlamaForCausalLM(config)
    return GPT(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads, seq=args.seq)


def loss_of(model, args, tokens):
    if args.model == "llama":
        return model(input_ids=tokens, labels=tokens).loss
    return model(tokens[:, :-1], tokens[:, 1:])


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(args, device, forward, backward, step, warm=lambda: None, before_step=None, after_step=None):
    """Each timed step's (forward, backward, step) seconds, the phases ended by a synchronization; `warm` is
    called once the warm-up steps are done, `before_step` and `after_step` around each step, untimed."""
    generator = torch.Generator().manual_seed(1)
    phases = []
    for number in range(args.steps):
        if number == WARMUP_STEPS:
            warm()
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator).to(device)
        synchronize(device)
        start = time.perf_counter()
        loss = forward(tokens)
        synchronize(device)
        forwarded = time.perf_counter()
        backward(loss)
        synchronize(device)
        backwarded = time.perf_counter()
        if before_step is not None:
            before_step()
        stepping = time.perf_counter()
        step()
        synchronize(device)
        phases.append((forwarded - start, backwarded - forwarded, time.perf_counter() - stepping))
        if after_step is not None:
            after_step()
    return phases[WARMUP_STEPS:]


def summary(args, phases, parameters):
    """s/step and its phases (medians), tokens/s, model TFLOPS and MFU."""
    totals = [sum(p) for p in phases]
    seconds = statistics.median(totals)
    tokens = args.batch * args.seq
    flops = tokens * (6 * parameters + 12 * args.layers * args.hidden * args.seq)
    tflops = flops / seconds / 1e12
    return {"s_per_step": seconds,
            "forward_s": statistics.median(p[0] for p in phases),
            "backward_s": statistics.median(p[1] for p in phases),
            "step_phase_s": statistics.median(p[2] for p in phases),
            "tokens_per_s": tokens / seconds, "model_tflops": tflops,
            "mfu": tflops / args.peak_tflops if args.peak_tflops else None}


def plain_run(args, device):
    model = build_model(args).to(device=device, dtype=torch.bfloat16 if args.precision == "bf16" else None)
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, **fused)

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    phases = timed_steps(args, device, lambda tokens: loss_of(model, args, tokens), lambda loss: loss.backward(),
                         step)
    return summary(args, phases, sum(p.numel() for p in model.parameters()))


def strata_config(args, name, states, nvme_dir):
    device_fraction, host_fraction = CONFIGS[name]
    config = {"precision": args.precision,
              "optimizer": {"type": "adamw", "lr": 1e-4, "weight_decay": 0.01},
              "device": {"backend": args.device, "budget": int(device_fraction * states)},
              "nvme": {"dirs": [nvme_dir]},
              "log": {"level": "error"}}
    if args.device == "emulated":
        config["device"]["emulated_bandwidth_gbps"] = args.link_gbps
    if host_fraction is not None:
        config["host"] = {"budget": int(host_fraction * states)}
    if name.endswith("+overlap"):
        config["optimizer"]["overlap"] = int(states)  # every group's copy
    return config


def initialize_within(model, config):
    """strata.initialize, a budget it refuses raised to the least it names (a small model's chunk group may
    need more than the fraction gives); the budgets used are in the results."""
    for _ in range(3):
        try:
            return strata.initialize(model, config)
        except (ValueError, MemoryError) as error:
            least = LEAST.search(str(error))
            if least is None:
                raise
            config.setdefault(least.group(1), {})["budget"] = parse_size(least.group(2).replace(" ", ""))
    return strata.initialize(model, config)


def strata_run(args, name, nvme_root):
    model = build_model(args)
    parameters = sum(p.numel() for p in model.parameters())
    nvme_dir = tempfile.mkdtemp(prefix=f"train-bench-{name.replace('+', '-')}-", dir=nvme_root)
    engine = initialize_within(model, strata_config(args, name, 16 * parameters, nvme_dir))
    before = {}  # the links' bytes and the pipeline's counts once warm
    steps = []    # each timed step's last_step, and the bytes its step phase moved by link

    def warm():
        stats = engine.stats()
        before.update({link: v["bytes"] for link, v in stats["links"].items()})
        before["planned_iterations"] = stats["pipeline"].get("planned_iterations", 0)
        before["fence_waits"] = stats["fence_waits"]

    moved = {}  # the links' bytes as the step begins

    def before_step():
        moved.update(link_bytes(engine))

    def after_step():
        if before:
            steps.append(dict(engine.last_step, step_bytes={k: v - moved[k] for k, v in link_bytes(engine).items()}))

    phases = timed_steps(args, engine.device, lambda tokens: loss_of(model, args, tokens), engine.backward,
                         engine.step, warm, before_step, after_step)
    stats = engine.stats()
    out = summary(args, phases, parameters)
    out.update({
        "host_syncs_per_step": stats["last_step"].get("host_syncs"),
        # moves that waited for the GPU to finish with a chunk torch let go (on strata's threads or the host's)
        "fence_waits_per_step": (stats["fence_waits"] - before["fence_waits"]) / len(phases),
        "stall_fraction": stats["pipeline"].get("stall_fraction"),
        # the plan's own figures: its predicted step (issue 24: within 15% of the measured one) and the chunk
        # groups it updates on the device
        "predicted_step_s": stats["pipeline"].get("plan", {}).get("predicted_step_seconds"),
        "updates_on_device": stats["pipeline"].get("plan", {}).get("updates_on_device"),
        # optimizer.overlap: the last step's groups updated in backward (confirmed, and redone) and the wait for them
        "overlap_groups": stats["last_step"].get("overlap_groups"),
        "redone_groups": stats["last_step"].get("redone_groups"),
        "overlap_wait_s": stats["last_step"].get("phases", {}).get("overlap_wait"),
        "bytes_per_step": {link: (v["bytes"] - before.get(link, 0)) / len(phases)
                           for link, v in stats["links"].items()},
        "planned_steps": stats["pipeline"].get("planned_iterations", 0) - before["planned_iterations"],
        "budgets": {tier: usage["capacity_bytes"] for tier, usage in stats["tiers"].items()},
        "accounting": step_accounting(args, steps, [p[2] for p in phases], parameters),
    })
    engine.close()  # its chunks leave the device before the next run's
    del engine, model
    gc.collect()  # the engine and its optimizer refer to each other
    return out


def link_bytes(engine):
    return {link: v["bytes"] for link, v in engine.stats()["links"].items()}


def optimizer_rate(args, parameters, runs=3):
    """Parameters a second `strata bench optim` updates on this machine, `parameters` of them in the precision
    of the run (its bf16: bf16 parameters and gradients, fp32 master and states), the median of `runs` runs (a
    shared machine's memory bandwidth varies from run to run); None without the CLI."""
    if not args.strata_bin or not os.path.exists(args.strata_bin):
        return None
    rates = []
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "optim.json")
        for _ in range(runs):
            subprocess.run([args.strata_bin, "bench", "optim", "--params", str(parameters), "--dtype",
                            args.precision, "--json", out], check=True, capture_output=True, text=True)
            with open(out) as f:
                rates.append(json.load(f)["gparams_per_s"] * 1e9)
    return statistics.median(rates)


def step_accounting(args, steps, step_phases, parameters):
    """Where the timed steps' step phases went (means), against their parts (the module docstring)."""
    mean = statistics.fmean
    names = sorted({name for s in steps for name in s["phases"]})
    phases = {name: mean(s["phases"].get(name, 0.0) for s in steps) for name in names}
    links = sorted({link for s in steps for link in s["step_bytes"]})
    moved = {link: mean(s["step_bytes"][link] for s in steps) for link in links}
    kernel_s = sum(s["phases"].get("kernel", 0.0) for s in steps)
    kernel_rate = sum(s["kernel_elems"] for s in steps) / kernel_s if kernel_s else None
    bench_rate = args.optimizer_rate
    out = {"phases_s": phases, "accounted_s": mean(s["seconds"] for s in steps),
           "step_phase_s": mean(step_phases), "step_bytes": moved, "kernel_params_per_s": kernel_rate,
           "bench_params_per_s": bench_rate, "parts_s": None, "step_over_parts": None, "kernel_over_bench": None,
           "step_over_update": None}
    if bench_rate:
        kernel_elems = mean(s["kernel_elems"] for s in steps)
        link_seconds = sum(moved.values()) / (args.link_gbps * 1e9) if args.device == "emulated" else 0.0
        out["parts_s"] = kernel_elems / bench_rate + link_seconds
        out["step_over_parts"] = out["step_phase_s"] / out["parts_s"] if out["parts_s"] else None
        out["kernel_over_bench"] = kernel_rate / bench_rate if kernel_rate else None
        out["step_over_update"] = out["step_phase_s"] / (parameters / bench_rate)
    return out


def print_accounting(results):
    """The second table: where each strata run's step phase went."""
    print(f"\n{'step phase':<17}{'ms':>8}{'parts':>8}{'x parts':>8}{'x update':>9}{'kernel':>8}{'unacc.':>8}"
          "  largest phases (ms)")
    for name, r in results.items():
        a = r.get("accounting")
        if a is None:
            continue
        top = sorted(a["phases_s"].items(), key=lambda kv: -kv[1])[:5]
        unaccounted = a["step_phase_s"] - sum(a["phases_s"].values())
        print(f"{name:<17}{1e3 * a['step_phase_s']:>8.1f}{_figure(a['parts_s'] and 1e3 * a['parts_s'], '.1f'):>8}"
              f"{_figure(a['step_over_parts'], '.2f'):>8}{_figure(a['step_over_update'], '.2f'):>9}"
              f"{_figure(a['kernel_over_bench'], '.2f'):>8}{1e3 * unaccounted:>8.1f}  "
              + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in top))


def _figure(value, spec):
    return "" if value is None else format(value, spec)


def print_table(args, results):
    plain = results["plain"]["s_per_step"]
    print(f"{args.model}: {args.layers} layers, hidden {args.hidden}, {args.batch} x {args.seq} tokens, "
          f"{args.precision}, device {args.device}" + (f" (links {args.link_gbps} GB/s)" if args.device ==
                                                       "emulated" else "")
          + (f"; plain backward {results['plain']['backward_over_update']:.2f}x the update"
             if "backward_over_update" in results["plain"] else ""))
    print(f"{'run':<17}{'s/step':>9}{'fwd':>8}{'bwd':>8}{'step':>8}{'tokens/s':>11}{'TFLOPS':>8}{'MFU':>7}"
          f"{'x plain':>9}{'syncs':>7}{'waits':>7}{'stall':>7}{'plan s':>8}{'on dev':>7}  bytes/step by link")
    for name, r in results.items():
        mfu = f"{r['mfu']:.2f}" if r["mfu"] is not None else "-"
        syncs = r.get("host_syncs_per_step")
        waits = r.get("fence_waits_per_step")
        stall = r.get("stall_fraction")
        links = ", ".join(f"{link} {bytes_ / 2**20:.1f}MiB" for link, bytes_ in r.get("bytes_per_step", {}).items()
                          if bytes_)
        print(f"{name:<17}{r['s_per_step']:>9.4f}{r['forward_s']:>8.4f}{r['backward_s']:>8.4f}"
              f"{r['step_phase_s']:>8.4f}{r['tokens_per_s']:>11.0f}{r['model_tflops']:>8.3f}{mfu:>7}"
              f"{plain / r['s_per_step']:>9.2f}{'' if syncs is None else syncs:>7}"
              f"{'' if waits is None else f'{waits:.0f}':>7}"
              f"{'' if stall is None else f'{stall:.2f}':>7}{_figure(r.get('predicted_step_s'), '.4f'):>8}"
              f"{_figure(r.get('updates_on_device'), 'd'):>7}  {links}")


def write_json(args, results):
    """The run's flags and results into --json's file, if given."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


def fit_backward_to_update(args, device, update_s, tries=3):
    """Plain PyTorch's results at the sequence length whose backward is nearest --backward-to-update times the
    update (`update_s`); args.seq is left at that length. Backward is not proportional to the tokens at the
    shortest lengths (each module's fixed cost), so each guess is measured and the length refitted from it."""
    target = args.backward_to_update * update_s
    tried = {}  # sequence length -> plain's results
    while True:
        tried[args.seq] = plain_run(args, device)
        backward = tried[args.seq]["backward_s"]
        guess = max(1, round(args.seq * target / backward))
        if len(tried) == tries or guess in tried or abs(backward / target - 1) <= 0.2:
            break
        args.seq = guess
    args.seq = min(tried, key=lambda seq: abs(tried[seq]["backward_s"] / target - 1))
    return tried[args.seq]


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda") if args.device == "cuda" else torch.device("cpu")
    model = build_model(args)
    parameters = sum(p.numel() for p in model.parameters())
    del model
    args.optimizer_rate = optimizer_rate(args, parameters)
    if args.backward_to_update is not None:
        if not args.optimizer_rate:
            sys.exit("train_bench.py: --backward-to-update needs the update's rate from `strata bench optim`; "
                     f"--strata-bin {args.strata_bin} is not there")
        results = {"plain": fit_backward_to_update(args, device, parameters / args.optimizer_rate)}
        parameters = sum(p.numel() for p in build_model(args).parameters())  # a GPT's positions follow --seq
    else:
        results = {"plain": plain_run(args, device)}
    if args.optimizer_rate:
        results["plain"]["backward_over_update"] = results["plain"]["backward_s"] * args.optimizer_rate / parameters
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as nvme_root:
        for name in args.configs.split(","):
            results[name] = strata_run(args, name, nvme_root)
    print_table(args, results)
    print_accounting(results)
    write_json(args, results)


if __name__ == "__main__":
    main()
