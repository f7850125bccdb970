#!/usr/bin/env bash
# Installs what is needed, builds into build/ and runs every test (ctest).
#   scripts/test.sh              all tests, in build/
#   scripts/test.sh --sanitize   the unit and nvme tests under ASan+UBSan, in build-asan/ (not gpu, not mpi)
# GPU tests (label gpu) skip themselves where no CUDA device is present.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/venv.sh   # .venv: PyTorch 2.13 and the other pinned Python packages
python3 scripts/check_layers.py  # every #include within its layer (docs/design.md, "Layers")

build_dir=build
cmake_args=()
ctest_args=()
if [ "${1:-}" = "--sanitize" ]; then
  build_dir=build-asan
  cmake_args=(-DSTRATA_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug)
  ctest_args=(-LE "gpu|mpi")  # OpenMPI under LeakSanitizer reports its own allocations
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
  export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
fi
scripts/build.sh "$build_dir" "${cmake_args[@]}"
mkdir -p "$build_dir/test-scratch"
cd "$build_dir"
ctest --output-on-failure -j "$(nproc)" --timeout 600 "${ctest_args[@]}"
