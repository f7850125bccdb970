#!/usr/bin/env bash
# Installs what is needed, builds into build/ and runs every test (ctest).
#   scripts/test.sh              all tests, in build/
#   scripts/test.sh --sanitize   the unit and nvme tests under ASan+UBSan, in build-asan/ (not gpu, not mpi)
#   scripts/test.sh --fuzz       each fuzz target (tests/fuzz) for 60 s with libFuzzer, in build-fuzz/ (Clang)
#   scripts/test.sh --isa avx2   the unit and nvme tests (the Python ones among them), in build/, with the kernels of
#                                a narrower CPU forced: torch's (ATEN_CPU_CAPABILITY) and strata's
#                                (STRATA_CPU_ISA); avx2, or scalar (strata's reference kernels; torch's at avx2,
#                                since torch's own scalar kernels round otherwise than its vector ones)
# GPU tests (label gpu) skip themselves where no CUDA device is present.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
if [ "${1:-}" = "--fuzz" ]; then
  exec scripts/fuzz.sh  # Clang's build of the fuzz targets alone: nothing of .venv or the checks below
fi
scripts/venv.sh   # .venv: PyTorch 2.13 and the other pinned Python packages
python3 scripts/check_layers.py  # every #include within its layer (docs/design.md, "Layers")
.venv/bin/python scripts/check_functions.py  # no function over 80 lines (docs/design.md, "Rules for the code")

build_dir=build
cmake_args=()
ctest_args=()
if [ "${1:-}" = "--isa" ]; then
  isa=${2:-}
  case "$isa" in
    avx2 | scalar) export ATEN_CPU_CAPABILITY=avx2 ;;
    *) echo "test.sh: --isa takes avx2 or scalar (the kernels of a narrower CPU than this one), not '${isa}'" >&2
       exit 2 ;;
  esac
  if ! grep -qw avx2 /proc/cpuinfo; then
    echo "test.sh: --isa $isa: this CPU lacks AVX2, which strata's tests against torch take as the narrowest" >&2
    exit 2
  fi
  export STRATA_CPU_ISA=$isa
  echo "test.sh: torch's kernels at ATEN_CPU_CAPABILITY=$ATEN_CPU_CAPABILITY, strata's at STRATA_CPU_ISA=$isa"
  # Every test the kernels' width can reach: the unit and nvme ones, the Python tests among them.
  ctest_args=(-L 'unit|nvme')
fi
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
