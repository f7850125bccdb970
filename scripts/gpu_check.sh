#!/usr/bin/env bash
# shellcheck disable=SC2317  # gpu_tests and drive run through part, under timeout
# On a GPU machine (the device tool's; see scripts/gpu_bundle.sh): issue 35's
# goals in one call, the goals table (scripts/gpu_goals.py) last.
#   scripts/gpu_check.sh [--large|--more] [BUNDLE]
# default: the gpu-labelled tests, the drive against fio, the CPU update (bf16,
#   and with 8-bit states), the 0.94B Llama in plain PyTorch and fits / streamed /
#   streamed+overlap / nvme, the adapter against plain PyTorch; about 5 minutes
#   on an H200.
# --large: a 7B Llama from random bf16 safetensors shards (benchmarks/large_bench.py),
#   its states in host memory and NVMe beyond it; 2 to 3 minutes.
# --more: the rest (collectives, the drive to the device, the fp32 update, the
#   adapter's cost, the 0.2B GPT, gradient accumulation); about 4 minutes.
# Each part stops at its cap or at the call's deadline (GPU_CHECK_SECONDS,
# 470 s), whichever comes first; the table is printed from what finished.
# Scratch files (the NVMe tier, the weights) go to STRATA_SCRATCH (build/gpu-scratch,
# on the machine's disk); $OUT (or /tmp/strata-gpu) gets the table, its JSON and
# every log in logs.tar.gz. Exit status: 1 if a part failed or ran out of time.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
mode=default
if [[ "${1:-}" == --large || "${1:-}" == --more ]]; then mode=${1#--}; shift; fi
bundle=$(realpath "${1:-build/gpu-bundle}")
out=${OUT:-/tmp/strata-gpu}
scratch=${STRATA_SCRATCH:-$PWD/build/gpu-scratch}
logs="$scratch/logs"
budget_s=${GPU_CHECK_SECONDS:-470}
table_s=15  # kept back for the table and the archive
mkdir -p "$out" "$logs"
# NCCL from the toolkit, else the one Python's nvidia-nccl package brings.
nccl=""
for dir in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu; do
  [[ -e "$dir/libnccl.so.2" ]] && nccl=$dir && break
done
if [[ -z "$nccl" ]]; then
  nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
fi
export LD_LIBRARY_PATH="$bundle/lib${nccl:+:$nccl}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export STRATA_TEST_DIR="$scratch/tests"
export PYTHONPATH="$bundle/python" PYTHONUNBUFFERED=1
mkdir -p "$STRATA_TEST_DIR"
(nvidia-smi -L || echo "no nvidia-smi"; echo "NCCL from: ${nccl:-not found}"; free -g; df -h "$scratch") \
  > "$logs/machine.txt" 2>&1
strata="$bundle/bin/strata"
export bundle logs scratch strata
status=0
summary=""

# part NAME CAP_S COMMAND...: COMMAND's output into $logs/NAME.txt, stopped after
# CAP_S seconds or at the deadline, whichever comes first; skipped under 20 s left.
part() {
  local name=$1 cap=$2 left begun rc result
  shift 2
  left=$((budget_s - table_s - SECONDS))
  ((cap > left)) && cap=$left
  if ((cap < 20)); then
    summary+="$name: skipped (the call's ${budget_s} s were spent)"$'\n'
    status=1
    return
  fi
  # a function of this script runs in a shell of its own under timeout
  declare -F "$1" > /dev/null && set -- bash -c "$(declare -f "$1"); $1"
  begun=$SECONDS
  timeout --kill-after=5 "$cap" "$@" > "$logs/$name.txt" 2>&1
  rc=$?
  case $rc in
    0) result=ok ;;
    124|137) result="STOPPED at its ${cap} s"; status=1 ;;
    *) result="FAILED (exit $rc)"; status=1 ;;
  esac
  summary+="$name: $result, $((SECONDS - begun)) s"$'\n'
}

gpu_tests() {
  local test name failed=0
  for test in "$bundle"/tests/*; do
    name=$(basename "$test")
    if "$test" > "$logs/$name.log" 2>&1; then echo -n "$name: passed"; else echo -n "$name: FAILED"; failed=1; fi
    echo " ($(grep -c '^\[       OK \]' "$logs/$name.log") ok, $(grep -c '^\[  SKIPPED \]' "$logs/$name.log")" \
      "skipped, $(grep -c '^\[  FAILED  \]' "$logs/$name.log") failed lines)"
  done
  return "$failed"
}

# The drive, against fio where the machine has it (the bundle cannot carry fio's
# libraries); strata's own figures otherwise, and the table says whose.
drive() {
  local fio=()
  command -v fio > /dev/null && fio=(--compare-fio)
  mkdir -p "$scratch/io"
  "$strata" bench io --dir "$scratch/io" --file-size 2GiB --runs 3 "${fio[@]}" --json "$logs/bench-io.json"
}

llama=(--device cuda --model llama --layers 16 --hidden 2048 --heads 16 --vocab 32000 --seq 2048 --batch 4
       --precision bf16 --peak-tflops 989)
case $mode in
  default)
    part gpu-tests 90 gpu_tests
    part bench-io 60 drive
    part bench-optim-bf16 45 "$strata" bench optim --dtype bf16 --params 256M --json "$logs/bench-optim-bf16.json"
    # Issue 36: the bf16 and 8-bit states' CPU updates against the fp32 states' on the GPU host's cores.
    part bench-optim-bf16-states 30 "$strata" bench optim --state-format bf16 --params 256M \
      --json "$logs/bench-optim-bf16-states.json"
    part bench-optim-int8 45 "$strata" bench optim --state-format int8 --params 256M \
      --json "$logs/bench-optim-int8.json"
    # The goals' runs: plain PyTorch and strata's four of issue 35, a 0.94B Llama, 4 x 2048 tokens a step.
    part train-bench-llama 300 python3 benchmarks/train_bench.py "${llama[@]}" --steps 5 \
      --configs fits,streamed,streamed+overlap,nvme --nvme-dir "$scratch" --json "$logs/train-bench-llama.json"
    part adapter 60 python3 scripts/gpu_adapter_check.py --json "$logs/adapter.json"
    goals=(--train "$logs/train-bench-llama.json" --io "$logs/bench-io.json")
    ;;
  large)
    part large-bench 440 python3 benchmarks/large_bench.py --dir "$scratch/large" --peak-tflops 989 \
      --json "$logs/large-bench.json"
    rm -rf "$scratch/large/nvme"  # the weights stay for a second run on this machine
    goals=(--large "$logs/large-bench.json")
    ;;
  more)
    for buffers in device host; do
      flag=(); [[ $buffers == host ]] && flag=(--host-buffers)
      part "bench-comm-nccl-$buffers" 30 "$strata" bench comm --backend nccl "${flag[@]}" \
        --sizes 1MiB,4MiB,16MiB,64MiB,256MiB --iterations 50 --json "$logs/bench-comm-nccl-$buffers.json"
    done
    mkdir -p "$scratch/io"
    part bench-io-device 45 "$strata" bench io --dir "$scratch/io" --dest device --device-backend cuda \
      --json "$logs/bench-io-device.json"
    part bench-optim-fp32 45 "$strata" bench optim --dtype fp32 --params 256M --json "$logs/bench-optim-fp32.json"
    # The adapter's own cost a module on the GPU, and where it goes (200 modules of next to no compute).
    part adapter-cost 45 python3 benchmarks/adapter_cost.py --device cuda --profile 25 --json "$logs/adapter-cost.json"
    # Issue 24's GPT of 0.2B parameters, every configuration.
    part train-bench-gpt 120 python3 benchmarks/train_bench.py --device cuda --layers 12 --hidden 1024 --heads 16 \
      --vocab 32000 --seq 512 --batch 8 --precision bf16 --steps 6 --peak-tflops 989 --nvme-dir "$scratch" \
      --json "$logs/train-bench-gpt.json"
    # Issue 25: a 0.2B Llama, the device at half its parameters, 1 and 8 micro-batches of 2 x 1024 tokens in
    # both orders.
    part accumulation 120 python3 benchmarks/accumulation_bench.py --device cuda --model llama --layers 12 \
      --hidden 1024 --heads 16 --vocab 32000 --seq 1024 --batch 2 --precision bf16 --micro-batches 1,8 \
      --offload 2GiB --json "$logs/accumulation-bench.json"
    goals=()
    ;;
esac

{
  cat "$logs/machine.txt"
  printf '%s' "$summary"
  for log in "$logs"/*.txt; do
    [[ $(basename "$log") == machine.txt ]] && continue
    echo "== $(basename "$log" .txt)"
    tail -n 12 "$log"
  done
  echo
  if ((${#goals[@]})); then python3 scripts/gpu_goals.py "${goals[@]}" --json "$out/goals.json"; fi
} 2>&1 | tee "$out/gpu-check.txt"
tar -czf "$out/logs.tar.gz" -C "$scratch" logs
rm -rf "$logs" "$STRATA_TEST_DIR" "$scratch/io"
exit $status
