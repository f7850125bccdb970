#!/usr/bin/env python3
"""Fails on an #include that goes against strata's layers.

Each folder is a layer that may include only the layers below it (the table
below, also in docs/design.md); each public header in include/strata/ belongs
to the layer that implements it; a few headers are private to their folder;
foreign APIs (CUDA, NCCL, liburing, MPI, TBB) are included only where their
backend lives. Tests may include anything.

    scripts/check_layers.py [--root DIR]

Prints one line per offending include (file:line: what and why) and exits 1,
or prints a one-line summary and exits 0.
"""
import argparse
import pathlib
import re
import sys

# Layer: (the folders it holds, the layers it may include directly).
LAYERS = {
    "base": (["src/base"], []),
    "config": (["src/config"], ["base"]),
    "device": (["src/backends/device"], ["config"]),
    "storage": (["src/backends/storage"], ["config"]),
    "comm": (["src/backends/comm"], ["config"]),
    "optim": (["optim"], ["config"]),
    "memory": (["memory"], ["device", "storage", "comm"]),
    "schedule": (["offload/schedule"], ["memory"]),
    "training": (["offload/training"], ["schedule", "optim"]),
    "persist": (["offload/persist"], ["training"]),
    "workloads": (["offload/workloads"], ["schedule"]),
    "benchmarks": (["benchmarks"], ["persist", "workloads"]),
    "binding": (["python/src"], ["persist", "workloads"]),
    "tools": (["tools"], ["benchmarks"]),
}

# The public API: each header belongs to the layer that implements it.
PUBLIC_HEADERS = {
    "strata/status.h": "base",
    "strata/types.h": "base",
    "strata/buffer.h": "base",
    "strata/options.h": "config",
    "strata/device.h": "device",
    "strata/storage.h": "storage",
    "strata/file_system.h": "storage",
    "strata/comm.h": "comm",
    "strata/engine.h": "memory",
    "strata/access.h": "memory",
    "strata/stats.h": "memory",
    "strata/tensor.h": "memory",
    "strata/compute_seam.h": "memory",
    "strata/update_fence.h": "training",
    "strata/checkpoint.h": "persist",
    "strata/safetensors.h": "persist",
}

# Headers only their own folder may include.
PRIVATE_HEADERS = [
    "src/backends/device/capacity_ledger.h",
    "src/backends/device/cuda_pattern.h",
    "src/backends/storage/storage_util.h",
    "src/backends/storage/uring_check.h",
    "src/backends/storage/uring_files.h",
    "src/backends/storage/uring_ring.h",
    "offload/persist/checkpoint_internal.h",
    "optim/cpu/cpu_kernels_impl.h",
    "optim/cuda/cuda_kernels_launch.h",
]

# A foreign API's headers, and the folders (or files) that may include them.
FOREIGN = [
    (re.compile(r"cuda_runtime|cuda\.h|cuda_bf16|cuda_fp16"),
     ["src/backends/device", "src/backends/comm/nccl_comm.cc", "optim/cuda", "src/base/cuda_check.h"]),
    (re.compile(r"nccl\.h"), ["src/backends/comm/nccl_comm.cc"]),
    (re.compile(r"liburing"), ["src/backends/storage"]),
    (re.compile(r"mpi\.h"), ["src/backends/comm"]),
    (re.compile(r"tbb/"), ["src/base", "optim", "offload/training", "benchmarks"]),
]

SOURCE_SUFFIXES = {".h", ".cc", ".cu"}
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')


def allowed_layers():
    """Each layer and every layer below it, transitively."""
    closure = {}

    def below(layer):
        if layer not in closure:
            found = {layer}
            for dep in LAYERS[layer][1]:
                found |= below(dep)
            closure[layer] = found
        return closure[layer]

    for layer in LAYERS:
        below(layer)
    return closure


def layer_of_path(path):
    """The layer of a file given relative to the root, or None."""
    best = None
    for layer, (folders, _) in LAYERS.items():
        for folder in folders:
            if path.startswith(folder + "/") and (best is None or len(folder) > len(best[1])):
                best = (layer, folder)
    return best[0] if best else None


def under(path, places):
    return any(path == place or path.startswith(place + "/") for place in places)


def check_file(root, path, closure):
    problems = []
    if path.startswith("include/"):
        layer = PUBLIC_HEADERS.get(path[len("include/"):])
        if layer is None:
            return [f"{path}: a public header with no layer: add it to PUBLIC_HEADERS in scripts/check_layers.py"]
    else:
        layer = layer_of_path(path)
    if layer is None:
        return problems
    for number, line in enumerate((root / path).read_text(errors="replace").splitlines(), 1):
        match = INCLUDE.match(line)
        if not match:
            continue
        bracket, target = match.groups()
        where = f"{path}:{number}"
        for pattern, places in FOREIGN:
            if pattern.search(target) and not under(path, places):
                problems.append(f"{where}: <{target}> belongs to a backend: only {', '.join(places)} include it")
        if bracket == "<":
            continue
        if path.startswith("include/") and not target.startswith("strata/"):
            problems.append(f'{where}: public header includes "{target}": the public API includes only strata/ headers')
            continue
        target_layer = PUBLIC_HEADERS.get(target) if target.startswith("strata/") else layer_of_path(target)
        if target_layer is None:
            if target.startswith("strata/"):
                problems.append(f'{where}: "{target}" is not a public header: add it to PUBLIC_HEADERS')
            continue
        if target_layer not in closure[layer]:
            problems.append(f'{where}: "{target}" is in layer {target_layer}, above or beside {layer} '
                            f"(which may include {', '.join(sorted(closure[layer]))})")
        if target in PRIVATE_HEADERS and not path.startswith(target.rsplit("/", 1)[0] + "/"):
            problems.append(f'{where}: "{target}" is private to {target.rsplit("/", 1)[0]}/')
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=pathlib.Path(__file__).resolve().parent.parent, type=pathlib.Path)
    args = parser.parse_args()
    closure = allowed_layers()
    files = sorted(str(p.relative_to(args.root)) for p in args.root.rglob("*")
                   if p.suffix in SOURCE_SUFFIXES and p.is_file()
                   and not any(part.startswith(("build", ".")) or part == "tests" for part in p.relative_to(args.root).parts))
    problems = [problem for path in files for problem in check_file(args.root, path, closure)]
    for problem in problems:
        print(problem)
    if problems:
        print(f"check_layers: {len(problems)} include(s) against the layers (scripts/check_layers.py has the table)")
        return 1
    print(f"check_layers: {len(files)} files, every include within its layer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
