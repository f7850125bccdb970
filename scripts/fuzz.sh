#!/usr/bin/env bash
# Builds the fuzz targets (tests/fuzz: libFuzzer, ASan, UBSan) with Clang
# into build-fuzz/ and runs them.
#   scripts/fuzz.sh                      each target for 60 s (STRATA_FUZZ_SECONDS) from its seeds (ctest -L fuzz),
#                                        as CI does
#   scripts/fuzz.sh TARGET SECONDS [FLAGS...]
#                                        a long campaign of one target (options, safetensors, checkpoint) on
#                                        every core: what it finds stays in build-fuzz/fuzz/corpus/TARGET (the
#                                        next campaign starts from there), a crashing input in
#                                        build-fuzz/fuzz/findings/; FLAGS go to libFuzzer
# Needs clang-14 and libclang-rt-14-dev (scripts/install_deps.sh installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=build-fuzz
generator=()
if [ ! -f "$build_dir/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
# Configured every time, so that STRATA_FUZZ_SECONDS (ctest's run of each target) takes effect.
CC=clang-14 CXX=clang++-14 cmake -S . -B "$build_dir" "${generator[@]}" -DSTRATA_FUZZ=ON -DSTRATA_WERROR=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_FUZZ_SECONDS="${STRATA_FUZZ_SECONDS:-60}" >/dev/null
cmake --build "$build_dir" -j "$(nproc)" --target strata_fuzz_targets
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
if [ $# -eq 0 ]; then
  cd "$build_dir"
  exec ctest --output-on-failure -L fuzz
fi
target=$1
seconds=${2:?"fuzz.sh: TARGET SECONDS: how long to run $target, in seconds"}
shift 2
binary="$build_dir/fuzz/fuzz_$target"
if [ ! -x "$binary" ]; then
  echo "fuzz.sh: no target '$target': one of $(ls tests/fuzz/corpus | tr '\n' ' ')" >&2
  exit 2
fi
root=$(pwd)
found="$root/$build_dir/fuzz/corpus/$target"
findings="$root/$build_dir/fuzz/findings"
logs="$root/$build_dir/fuzz/logs/$target"  # libFuzzer's jobs write their fuzz-N.log where they run
mkdir -p "$found" "$findings" "$logs"
cd "$logs"
exec "$root/$binary" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=4096 -malloc_limit_mb=256 \
  -max_len=131072 -print_final_stats=1 -jobs="$(nproc)" -workers="$(nproc)" -artifact_prefix="$findings/$target-" \
  "$@" "$found" "$root/tests/fuzz/corpus/$target"
