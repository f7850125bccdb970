"""Fine-tune a GPT-style decoder with strata, its states spread over device, host and NVMe.

    .venv/bin/python examples/finetune.py [--steps 30] [--out build/demo] [--init state_dict.pt]
        [--accumulation standard|layered] [--micro-batches M]
    mpirun -np 2 .venv/bin/python examples/finetune.py     # data parallel: each rank a share of every batch

The model is plain PyTorch (examples/gpt.py); strata.initialize moves its
parameters, gradients and AdamW states into chunks. By default the device
budget is 20% of the model states (less than the parameters alone), the host
budget 90% of the optimizer states (at least a quarter of the model states:
int8 states are small), and the rest lives on NVMe under
OUT/nvme. The corpus is strata's own sources and docs, as bytes. Each step is
engine.train_step over --micro-batches micro-batches, in the --accumulation
order (layered: each block runs for every micro-batch in a row).

Under mpirun (or torchrun) every rank trains on its share of each batch of
--batch sequences; the budgets are each rank's, and each rank keeps 1/W of
the optimizer states. Rank 0 prints and writes the report (with every
rank's bytes of each chunk kind, and the communication per step).

At the end the same model trains with plain PyTorch (everything in memory,
torch.optim.AdamW) from the same weights on the same batches for a few
steps, and OUT gets report.json, memory.png (bytes per tier across the
moments of one iteration) and loss.png.
"""

import argparse
import collections
import copy
import glob
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "build", "demo"), help="output directory (default build/demo)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps with strata (default 30)")
    p.add_argument("--baseline-steps", type=int, default=6, help="steps of plain PyTorch at the end (default 6; 0: none)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (bytes of the corpus)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--states", choices=["fp32", "bf16", "int8"], default="fp32",
                   help="optimizer.states: the moments' format (default fp32)")
    p.add_argument("--device", choices=["emulated", "cuda"], default="emulated",
                   help="the device tier: host memory standing in for a GPU (default), or CUDA")
    p.add_argument("--device-budget", help="bytes or e.g. 48MiB (default: 20%% of the model states)")
    p.add_argument("--host-budget", help="bytes or e.g. 96MiB (default: 90%% of the optimizer states)")
    p.add_argument("--nvme-dir", help="directory of the NVMe tier (default OUT/nvme)")
    p.add_argument("--init", help="a saved state dict (torch.save) to start from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-params", action="store_true",
                   help="data parallel: shard the parameters too (comm.shard_params, ZeRO-3)")
    p.add_argument("--comm-backend", choices=["auto", "host", "nccl"], default="auto",
                   help="data parallel: what carries the collectives (comm.backend; nccl also for one process)")
    p.add_argument("--save-every", type=int, default=0,
                   help="save a checkpoint every N steps under OUT/ckpt, the newest two kept (default 0: none)")
    p.add_argument("--async-save", action="store_true",
                   help="with --save-every: write each checkpoint while the next steps train")
    p.add_argument("--accumulation", choices=["standard", "layered"], default="standard",
                   help="the order of a step's micro-batches (engine.train_step): standard, or layered (each block "
                        "for every micro-batch in a row: its chunks move once a step)")
    p.add_argument("--micro-batches", type=int,
                   help="micro-batches each rank's share of a batch is split into (default: 1 standard, one a "
                        "sequence layered)")
    p.add_argument("--short", action="store_true", help="a tiny model and a few steps (the test suite's run)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (one line per step instead)")
    args = p.parse_args(argv)
    if args.short:
        args.layers, args.hidden, args.heads, args.seq, args.batch = 2, 64, 2, 32, 4
        args.steps, args.baseline_steps = min(args.steps, 6), min(args.baseline_steps, 3)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.micro_batches is not None and args.micro_batches < 1:
        p.error("--micro-batches must be >= 1")
    return args


def corpus():
    """strata's own sources and docs, as one tensor of bytes."""
    patterns = ["README.md", "docs/*.md", "include/strata/*.h", "src/*.cc", "memory/*.cc", "offload/*.cc",
                "optim/*.cc", "examples/*.py", "python/strata/*.py"]
    data = bytearray()
    for pattern in patterns:
        for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
            with open(path, "rb") as f:
                data += f.read()
    if len(data) < 4096:
        raise SystemExit(f"finetune: the corpus under {ROOT} has {len(data)} bytes; run from a strata checkout")
    return torch.frombuffer(data, dtype=torch.uint8).long()


def make_batches(text, steps, batch, seq, seed):
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(text) - seq - 1, (steps, batch), generator=generator)
    return [torch.stack([text[s:s + seq + 1] for s in row.tolist()]) for row in starts]


def moment_bytes(numel, states):
    """exp_avg and exp_avg_sq of a tensor: int8 states are 8-bit blocks of 256 with a 4-byte scale each, for
    tensors of at least 4096 elements in whole blocks (the others' in fp32)."""
    if states == "int8" and numel >= 4096 and numel % 256 == 0:
        return 2 * numel // 256 * 260
    return (4 if states == "bf16" else 8) * numel


def model_state_bytes(model, precision, states="fp32"):
    """Parameters, gradients and optimizer states (AdamW), and the optimizer states alone."""
    n = sum(p.numel() for p in model.parameters())
    moments = sum(moment_bytes(p.numel(), states) for p in model.parameters())
    if precision == "fp32":
        return 8 * n + moments, moments            # param, grad; the moments
    return 8 * n + moments, 4 * n + moments        # bf16 param and grad, fp32 master; the master and moments


def size(text, default):
    import strata
    return default if text is None else strata.parse_size(text)


def plain_pytorch(model, batches, lr):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, times = [], []
    for tokens in batches:
        start = time.perf_counter()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # waits for the GPU, if any
        times.append(time.perf_counter() - start)
    return losses, times


def steady(times):
    """The median step time after the first two (warm-up: the trace and the first plan)."""
    return statistics.median(times[2:] if len(times) > 3 else times)


def plots(out, report, timeline):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for tier, color in (("device", "tab:green"), ("host", "tab:blue"), ("nvme", "tab:red")):
        if timeline and tier in timeline[0]:
            ax.plot([m[tier] / 2**20 for m in timeline], label=f"{tier} used", color=color)
            if tier != "nvme":  # NVMe's capacity would flatten the rest
                ax.axhline(report["tier_budget_bytes"][tier] / 2**20, color=color, linestyle="--", linewidth=0.8,
                           label=f"{tier} budget")
    ax.set_xlabel("moment of the last iteration (forward, backward, then the step)")
    ax.set_ylabel("MiB")
    ax.set_title("strata: bytes per tier across one iteration")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "memory.png"), dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(range(1, len(report["loss"]) + 1), report["loss"], label="strata")
    if report["baseline_loss"]:
        ax.plot(range(1, len(report["baseline_loss"]) + 1), report["baseline_loss"], "o", label="plain PyTorch")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=100)
    plt.close(fig)


def mib(size_bytes):
    return f"{size_bytes / 2**20:.0f}MiB"


def new_model(args):
    return GPT(vocab=256, hidden=args.hidden, layers=args.layers, heads=args.heads, seq=args.seq)


# What the run's budgets and report are measured against.
Sizes = collections.namedtuple("Sizes", "params states optimizer_states device_budget host_budget")


def model_sizes(model, args):
    """The model's parameters and state bytes, and the tier budgets: given, or shares of the states."""
    states, optimizer_states = model_state_bytes(model, args.precision, args.states)
    return Sizes(params=sum(p.numel() for p in model.parameters()), states=states, optimizer_states=optimizer_states,
                 device_budget=size(args.device_budget, states // 5),
                 host_budget=size(args.host_budget, max(optimizer_states * 9 // 10, states // 4)))


def strata_config(args, sizes, nvme_dir):
    return {
        "precision": args.precision,
        "optimizer": {"type": "adamw", "lr": args.lr, "weight_decay": 0.01, "states": args.states},
        "device": {"backend": args.device, "budget": sizes.device_budget},
        "host": {"budget": sizes.host_budget},
        # The chunk size, the NVMe capacity and the device memory activations
        # take are strata's defaults: derived from the budgets and the model,
        # and measured (on the emulated device activations stay in process memory).
        "nvme": {"dirs": [nvme_dir]},
        "log": {"level": "warning"},
        "comm": {"shard_params": args.shard_params, "backend": args.comm_backend},
    }


def describe_start(engine, args, sizes, nvme_dir, say):
    """Checks that the batch splits over the ranks, says what lives where, and returns the bytes of chunks
    per home tier."""
    world = engine.world_size
    if engine.comm is not None and engine.rank == 0:
        print(f"strata: collectives over {engine.comm.describe()}")
    if args.batch % world:
        raise SystemExit(f"finetune: --batch {args.batch} does not split over {world} ranks: use a multiple of {world}")
    if args.micro_batches is None:
        args.micro_batches = args.batch // world if args.accumulation == "layered" else 1
    if (args.batch // world) % args.micro_batches:
        raise SystemExit(f"finetune: each rank's {args.batch // world} sequences do not split into --micro-batches "
                         f"{args.micro_batches}: give a divisor of {args.batch // world}")
    homes = {}
    for chunk in engine.engine.chunks():
        homes[chunk["home"]] = homes.get(chunk["home"], 0) + chunk["size_bytes"]
    say(f"model: {sizes.params / 1e6:.1f}M parameters, model states {mib(sizes.states)} "
        f"(optimizer states {mib(sizes.optimizer_states)}); budgets: device {mib(sizes.device_budget)}, "
        f"host {mib(sizes.host_budget)}, NVMe under {nvme_dir}" + (f"; {world} ranks" if world > 1 else ""))
    say("homes" + (" (rank 0)" if world > 1 else "") + ": " +
        ", ".join(f"{tier} {mib(b)}" for tier, b in sorted(homes.items())))
    return homes


def train(engine, args, batches, say):
    """The strata steps, each rank on its share of each batch, with the checkpoints asked for. Returns the
    losses (the mean over the ranks), the step times and the time each save took of the loop."""
    rank, world = engine.rank, engine.world_size
    share = args.batch // world
    tokens_per_step = args.batch * args.seq
    losses, times, save_times = [], [], []
    progress = None
    if not args.no_progress and rank == 0:
        from tqdm import tqdm
        progress = tqdm(total=args.steps, unit="step", dynamic_ncols=True)
    for step, tokens in enumerate(batches, 1):
        start = time.perf_counter()
        tokens = tokens[rank * share:(rank + 1) * share].to(engine.device)
        # The step's micro-batches, their gradients averaged: the whole share's mean gradient.
        loss = engine.train_step(tokens.chunk(args.micro_batches), lambda m, t: m(t[:, :-1], t[:, 1:]),
                                 accumulation=args.accumulation).mean()
        losses.append(loss.item() if world == 1 else engine.comm.all_reduce_sum([loss.item()])[0] / world)
        if args.save_every and step % args.save_every == 0:  # the time the training loop spends on it
            saving = time.perf_counter()
            engine.save_checkpoint(checkpoint_root(args), keep_last=2, asynchronous=args.async_save)
            save_times.append(time.perf_counter() - saving)
        times.append(time.perf_counter() - start)
        tiers = engine.stats()["tiers"]
        where = " ".join(f"{t[:3]}={u['used_bytes'] / 2**20:.0f}M" for t, u in tiers.items())
        status = {"loss": f"{losses[-1]:.3f}", "tok/s": f"{tokens_per_step / times[-1]:.0f}", "tiers": where}
        if progress is not None:
            progress.set_postfix(status)
            progress.update(1)
        else:
            say(f"step {step}/{args.steps} " + " ".join(f"{k} {v}" for k, v in status.items()), flush=True)
    if progress is not None:
        progress.close()
    if args.save_every:  # the last asynchronous save, waited for outside the loop's time
        engine.wait_checkpoint()
    return losses, times, save_times


def checkpoint_root(args):
    return os.path.join(args.out, "ckpt")


def chunk_bytes_per_rank(engine):
    """Every rank's bytes of each chunk kind, and of those stored (on the host and NVMe: a sharded run's
    gathered param chunks are on the device only), one dict per rank. Every rank calls it."""
    tiers_of_kind = engine.chunk_tiers()
    kinds = {kind: sum(tiers.values()) for kind, tiers in tiers_of_kind.items()}
    stored = {kind: tiers.get("host", 0) + tiers.get("nvme", 0) for kind, tiers in tiers_of_kind.items()}
    if engine.world_size == 1:
        return [kinds], [stored]
    names = sorted(kinds)
    row = [kinds[n] for n in names] + [stored[n] for n in names]
    gathered = engine.comm.all_gather(torch.tensor(row, dtype=torch.int64).numpy())
    rows = torch.frombuffer(bytearray(gathered), dtype=torch.int64).reshape(engine.world_size, -1).tolist()
    return [dict(zip(names, r[:len(names)])) for r in rows], [dict(zip(names, r[len(names):])) for r in rows]


def device_peak_bytes(engine, stats):
    """On a GPU, strata's chunks and PyTorch's activations and workspace at their peak; else None."""
    if engine.device.type != "cuda":
        return None
    return stats["tiers"]["device"]["peak_bytes"] + torch.cuda.max_memory_allocated()


def compare_with_pytorch(engine, args, initial, batches):
    """The first --baseline-steps batches with plain PyTorch from the same weights: losses, step times and
    (on a GPU) the peak bytes."""
    if not args.baseline_steps:
        return [], [], None
    print(f"plain PyTorch, everything in memory, {args.baseline_steps} steps on the same batches...")
    torch.manual_seed(args.seed)
    baseline = new_model(args)
    baseline.load_state_dict(initial)
    baseline = baseline.to(device=engine.device, dtype=torch.bfloat16 if args.precision == "bf16" else None)
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    baseline_batches = [t.to(engine.device) for t in batches[:args.baseline_steps]]
    losses, times = plain_pytorch(baseline, baseline_batches, args.lr)
    return losses, times, torch.cuda.max_memory_allocated() if engine.device.type == "cuda" else None


def make_report(args, stats, sizes, homes, per_rank, trained, baseline, hbm):
    """report.json: what ran, the losses and times of both runs, and the bytes per tier, link and rank."""
    rank_kinds, rank_stored = per_rank
    losses, times, save_times = trained
    baseline_losses, baseline_times = baseline
    pipeline = stats["pipeline"]
    return {
        "model": {"parameters": sizes.params, "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                  "seq": args.seq, "batch": args.batch, "precision": args.precision},
        "accumulation": {"order": args.accumulation, "micro_batches": args.micro_batches,
                         "boundary_bytes": stats["last_step"].get("boundary_bytes", 0),
                         "moved_bytes_last_step": stats["last_step"].get("moved_bytes", {})},
        "world_size": len(rank_kinds),  # one entry per rank
        "rank_chunk_bytes": rank_kinds,
        "rank_stored_bytes": rank_stored,
        "shard_params": args.shard_params,
        "comm": stats.get("comm"),
        "model_state_bytes": sizes.states,
        "loss": losses,
        "step_time_s": times,
        "train_seconds": sum(times),
        "checkpoint_seconds_in_loop": save_times,
        "baseline_loss": baseline_losses,
        "baseline_step_time_s": steady(baseline_times) if baseline_times else None,
        "baseline_step_times_s": baseline_times,
        "step_time_over_baseline": steady(times) / steady(baseline_times) if baseline_times else None,
        "tokens_per_second": args.batch * args.seq / steady(times),
        "tier_budget_bytes": {t: u["capacity_bytes"] for t, u in stats["tiers"].items()},
        "tier_peak_bytes": {t: u["peak_bytes"] for t, u in stats["tiers"].items()},
        "tier_home_bytes": homes,
        "bytes_moved": {link: v["bytes"] for link, v in stats["links"].items()},
        "stall_fraction_last_step": pipeline.get("stall_fraction"),
        "planned_iterations": pipeline.get("planned_iterations"),
        "timeline": stats["timeline"],
        "peak_hbm_bytes": hbm[0],  # strata's, then plain PyTorch's
        "baseline_peak_hbm_bytes": hbm[1],
    }


def print_summary(args, report, sizes):
    """What the report says, in a few lines."""
    losses, times = report["loss"], report["step_time_s"]
    baseline_losses, baseline_times = report["baseline_loss"], report["baseline_step_times_s"]
    world, save_times = report["world_size"], report["checkpoint_seconds_in_loop"]
    accumulation = report["accumulation"]
    print(f"strata: {steady(times):.3f} s/step ({report['tokens_per_second']:.0f} tokens/s), loss "
          f"{losses[0]:.3f} -> {losses[-1]:.3f}; {accumulation['micro_batches']} micro-batches a step, "
          f"{accumulation['order']} order, {mib(sum(accumulation['moved_bytes_last_step'].values()))} moved in "
          "the last step")
    if baseline_times:
        same = max(abs(a - b) / abs(b) for a, b in zip(losses, baseline_losses))
        print(f"plain PyTorch: {steady(baseline_times):.3f} s/step; strata / PyTorch = "
              f"{report['step_time_over_baseline']:.2f}; largest relative loss difference over "
              f"{len(baseline_losses)} steps {same:.1e}")
    print("peaks" + (" (rank 0)" if world > 1 else "") + ": " +
          ", ".join(f"{t} {mib(report['tier_peak_bytes'][t])} of {mib(report['tier_budget_bytes'][t])}"
                    for t in report["tier_peak_bytes"]))
    if world > 1:
        comm = report["comm"]
        held = [sum(k.get(n, 0) for n in ("master", "exp_avg", "exp_avg_sq")) for k in report["rank_chunk_bytes"]]
        print(f"optimizer states per rank: {', '.join(mib(b) for b in held)} of {mib(sizes.optimizer_states)}; "
              f"params stored per rank: {', '.join(mib(k.get('param', 0)) for k in report['rank_stored_bytes'])}; "
              f"rank 0 sent {mib(comm['last_step_bytes'])} in the last step "
              f"(ZeRO-3 would send {mib(comm['zero3_bytes_per_step'])})")
    if save_times:
        print(f"checkpoints: {len(save_times)} {'asynchronous' if args.async_save else 'synchronous'} saves under "
              f"{checkpoint_root(args)}, {sum(save_times):.2f} s of the training loop's {sum(times):.2f} s")
    print(f"wrote {args.out}/report.json, memory.png, loss.png")


def main(argv=None):
    args = parse_args(argv)
    import strata  # after argument parsing: --help works without the build

    os.makedirs(args.out, exist_ok=True)
    nvme_dir = args.nvme_dir or os.path.join(args.out, "nvme")
    os.makedirs(nvme_dir, exist_ok=True)
    torch.manual_seed(args.seed)
    model = new_model(args)
    if args.init:
        model.load_state_dict(torch.load(args.init, map_location="cpu"))
    initial = copy.deepcopy(model.state_dict()) if args.baseline_steps else None
    sizes = model_sizes(model, args)
    engine = strata.initialize(model, strata_config(args, sizes, nvme_dir))
    say = print if engine.rank == 0 else (lambda *a, **k: None)
    homes = describe_start(engine, args, sizes, nvme_dir, say)

    batches = make_batches(corpus(), args.steps, args.batch, args.seq, args.seed + 1)
    trained = train(engine, args, batches, say)
    stats = engine.stats()
    per_rank = chunk_bytes_per_rank(engine)
    if engine.rank != 0:
        return None

    strata_hbm = device_peak_bytes(engine, stats)  # before the baseline resets the peak
    baseline_losses, baseline_times, baseline_hbm = compare_with_pytorch(engine, args, initial, batches)
    report = make_report(args, stats, sizes, homes, per_rank, trained, (baseline_losses, baseline_times),
                         (strata_hbm, baseline_hbm))
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    plots(args.out, report, stats["timeline"])
    print_summary(args, report, sizes)
    return report


if __name__ == "__main__":
    main()
