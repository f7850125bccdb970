"""The PyTorch adapter's own cost: microseconds a module spends in strata's hooks, with compute removed.

    python3 benchmarks/adapter_cost.py [--modules 200] [--steps 8] [--profile 12] [--device cuda] [--json OUT]

A stack of `--modules` modules whose forward is one multiply by a one-element parameter (compute about
nothing), each its own chunk moment, trained through strata with everything on the device (the
emulated one, or a GPU with `--device cuda`, each step waited for) and in plain PyTorch with the same
AdamW. The difference of the two steps' medians over the number of modules is the adapter's cost a
module (forward, backward and its share of the step); `--profile N` prints the N functions strata's
steps spend the most time in (cProfile, tottime).
"""

import argparse
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time

import torch

import strata

WARMUP_STEPS = 2


class Scale(torch.nn.Module):
    """x * w: a module with a parameter and next to no compute."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.w


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modules", type=int, default=200)
    p.add_argument("--steps", type=int, default=8, help=f"steps a run; the first {WARMUP_STEPS} are not timed")
    p.add_argument("--profile", type=int, default=0, help="print the N costliest functions of strata's steps")
    p.add_argument("--device", choices=["emulated", "cuda"], default="emulated",
                   help="where the modules compute: the emulated device (the host) or a GPU")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.steps <= WARMUP_STEPS or args.modules < 1:
        p.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps and --modules be at least 1")
    return args


def step_seconds(steps, step, device):
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARMUP_STEPS:])


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    x = torch.ones(1, device=device)
    plain = torch.nn.Sequential(*[Scale() for _ in range(args.modules)]).to(device)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-4)

    def plain_step():
        plain(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model = torch.nn.Sequential(*[Scale() for _ in range(args.modules)])
    with tempfile.TemporaryDirectory() as nvme:
        # One element a chunk: each module is its own moment, as a large model's layers are.
        engine = strata.initialize(model, {"device": {"backend": args.device}, "nvme": {"dirs": [nvme]},
                                           "chunk": {"size_elems": 1}, "non_model_memory": 0,
                                           "log": {"level": "error"}})

        def strata_step():
            engine.backward(model(x).sum())
            engine.step()

        plain_s = step_seconds(args.steps, plain_step, device)
        strata_s = step_seconds(args.steps, strata_step, device)
        profile = ""
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(3):
                strata_step()
            profiler.disable()
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.profile)
            profile = out.getvalue()
        syncs = engine.stats()["last_step"]["host_syncs"]
    result = {"modules": args.modules, "device": args.device, "plain_s_per_step": plain_s, "strata_s_per_step": strata_s,
              "us_per_module": (strata_s - plain_s) / args.modules * 1e6, "host_syncs_per_step": syncs}
    print(f"{args.modules} modules: plain {plain_s * 1e3:.2f} ms a step, strata {strata_s * 1e3:.2f} ms; "
          f"the adapter {result['us_per_module']:.1f} us a module; {syncs} host syncs a step")
    if profile:
        print(profile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
