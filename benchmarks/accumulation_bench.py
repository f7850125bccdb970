"""Layered against standard gradient accumulation in the adapter (issue 25): a step of M micro-batches by
engine.train_step, with the device below the parameters, so that each step moves them.

    python3 benchmarks/accumulation_bench.py [--device emulated|cuda] [--model gpt|llama] [--layers 8]
        [--hidden 256] [--seq 128] [--batch 1] [--micro-batches 1,2,4,8,16] [--device-fraction 0.5]
        [--link-gbps 1] [--offload SIZE] [--steps 4] [--json OUT]

For each M and each order: seconds a step (the median after the first two), its bytes over each link, the
pipeline's stall fraction and the blocks' inputs held for backward (boundary_bytes; on the host with --offload,
a size for accumulation_offload); then the step's time over the standard order's.
The device holds --device-fraction of the parameters (in the compute dtype), the host all the states; on the
emulated device the links run at --link-gbps.
"""

import argparse
import gc
import os
import statistics
import sys
import time

import torch

import strata

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_bench import (WARMUP_STEPS, add_model_args, build_model, initialize_within, loss_of,  # noqa: E402
                         synchronize, write_json)

MODES = ("standard", "layered")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, layers=8, batch=1, steps=4)
    p.add_argument("--micro-batches", default="1,2,4,8,16", help="micro-batches a step, a list")
    p.add_argument("--device-fraction", type=float, default=0.5, help="the device budget, of the parameters")
    p.add_argument("--link-gbps", type=float, default=1.0, help="the emulated device's links, GB/s")
    p.add_argument("--offload", default="0", help="accumulation_offload: host bytes for the held inputs (0: none)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.steps <= WARMUP_STEPS:
        p.error(f"--steps {args.steps}: more than the {WARMUP_STEPS} warm-up steps, so that some are timed")
    try:
        args.micro_batches = [int(m) for m in args.micro_batches.split(",")]
    except ValueError:
        p.error(f"--micro-batches {args.micro_batches}: a list of ints, like 1,2,4,8")
    if min(args.micro_batches) < 1:
        p.error("--micro-batches: each at least 1")
    return args


def run(args, mode, micro_batches):
    model = build_model(args)
    parameters = sum(p.numel() for p in model.parameters())
    width = 2 if args.precision == "bf16" else 4
    config = {"precision": args.precision, "optimizer": {"type": "adamw", "lr": 1e-4, "weight_decay": 0.01},
              "device": {"backend": args.device, "budget": int(args.device_fraction * width * parameters)},
              "host": {"budget": 2 * 16 * parameters}, "accumulation": mode, "accumulation_offload": args.offload,
              "log": {"level": "error"}}
    if args.device == "emulated":
        config["device"]["emulated_bandwidth_gbps"] = args.link_gbps
    engine = initialize_within(model, config)
    generator = torch.Generator().manual_seed(1)
    seconds = []
    for _ in range(args.steps):
        data = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator).to(engine.device)
                for _ in range(micro_batches)]
        synchronize(engine.device)
        start = time.perf_counter()
        engine.train_step(data, lambda m, tokens: loss_of(m, args, tokens))
        synchronize(engine.device)
        seconds.append(time.perf_counter() - start)
    stats = engine.stats()
    last = stats["last_step"]
    out = {"s_per_step": statistics.median(seconds[WARMUP_STEPS:]), "moved_bytes": last["moved_bytes"],
           "moved_total": sum(last["moved_bytes"].values()), "stall_fraction": stats["pipeline"].get("stall_fraction"),
           "boundary_bytes": last["boundary_bytes"], "boundary_host_bytes": last["boundary_host_bytes"],
           "device_budget": stats["tiers"]["device"]["capacity_bytes"],
           "parameter_bytes": width * parameters}
    del engine, model
    gc.collect()
    return out


def print_table(args, results):
    print(f"{args.model}: {args.layers} layers, hidden {args.hidden}, micro-batches of {args.batch} x {args.seq} "
          f"tokens, {args.precision}, device {args.device} at {args.device_fraction} of the parameters"
          + (f" (links {args.link_gbps} GB/s)" if args.device == "emulated" else ""))
    print(f"{'M':>3} {'order':<9}{'s/step':>9}{'moved MiB':>11}{'h->d MiB':>10}{'stall':>7}{'held MiB':>10}"
          f"{'on host':>9}{'x standard':>12}")
    for m in args.micro_batches:
        for mode in MODES:
            r = results[f"{mode}/{m}"]
            ratio = r["s_per_step"] / results[f"standard/{m}"]["s_per_step"]
            stall = r["stall_fraction"]
            print(f"{m:>3} {mode:<9}{r['s_per_step']:>9.4f}{r['moved_total'] / 2**20:>11.1f}"
                  f"{r['moved_bytes'].get('host->device', 0) / 2**20:>10.1f}"
                  f"{'' if stall is None else f'{stall:.2f}':>7}{r['boundary_bytes'] / 2**20:>10.2f}"
                  f"{r['boundary_host_bytes'] / 2**20:>9.2f}{ratio:>12.2f}")


def main(argv=None):
    args = parse_args(argv)
    results = {f"{mode}/{m}": run(args, mode, m) for m in args.micro_batches for mode in MODES}
    print_table(args, results)
    write_json(args, results)


if __name__ == "__main__":
    main()
