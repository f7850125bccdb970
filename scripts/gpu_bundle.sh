#!/usr/bin/env bash
# Packs what the GPU checks need into build/gpu-bundle (about 13 MB), for a
# GPU machine that has CUDA's driver but none of strata's Debian packages:
# the gpu-labelled test binaries and the strata CLI, stripped, and the shared
# libraries they load from this machine (not NCCL's 200 MB: the GPU machine's
# own libnccl.so.2 is used). Run after scripts/build.sh build; then, through
# the device tool, carry build/gpu-bundle and run scripts/gpu_check.sh there.
#   scripts/gpu_bundle.sh [BUILD] [PYTHON_BUILD]
# PYTHON_BUILD: a build of the Python module for the GPU machine's Python
# (3.12; pyenv has it here with its headers), e.g.
#   cmake -S . -B build-py312 -G Ninja -DSTRATA_BUILD_TESTS=OFF \
#     -DPython3_EXECUTABLE=$HOME/.pyenv/versions/3.12.1/bin/python3.12 \
#     -Dpybind11_DIR="$(.venv/bin/python -m pybind11 --cmakedir)" && cmake --build build-py312 --target _strata
# (that Python has no pybind11 of its own: the one .venv pins is header-only)
# whose package goes into the bundle's python/ (gpu_check.sh then runs the adapter's checks).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
python_build=${2:-}
bundle="$build/gpu-bundle"
rm -rf "$bundle"
mkdir -p "$bundle/tests" "$bundle/bin" "$bundle/lib"
for test in cuda_device_test cuda_kernels_test nccl_comm_test comm_bench_test; do
  if [[ ! -x "$build/tests/$test" ]]; then
    echo "gpu_bundle: $build/tests/$test is missing: build with CUDA first (scripts/build.sh $build)" >&2
    exit 1
  fi
  strip -o "$bundle/tests/$test" "$build/tests/$test"
done
strip -o "$bundle/bin/strata" "$build/bin/strata"
modules=()
if [[ -n "$python_build" ]]; then
  mkdir -p "$bundle/python/strata"
  cp python/strata/*.py "$bundle/python/strata/"
  for module in "$python_build"/python/strata/_strata*.so; do
    strip -o "$bundle/python/strata/$(basename "$module")" "$module"
    modules+=("$bundle/python/strata/$(basename "$module")")
  done
fi
# Every library the binaries load, but the C and C++ runtimes (the GPU
# machine's are newer, and its NCCL needs its own) and NCCL.
for binary in "$bundle"/tests/* "$bundle/bin/strata" "${modules[@]}"; do
  ldd "$binary" | awk '$3 ~ /^\// {print $3}'
done | sort -u | while read -r library; do
  case "$(basename "$library")" in
    libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|ld-linux*|libstdc++.so.*|libgcc_s.so.*) ;;
    libnccl.so.*|libcuda.so.*) ;;
    *) cp -L "$library" "$bundle/lib/" ;;
  esac
done
du -sh "$bundle"
