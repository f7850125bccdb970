#!/usr/bin/env bash
# On a GPU machine (the device tool's; see scripts/gpu_bundle.sh): runs the
# gpu-labelled tests and the GPU benchmarks from the bundle, logs and JSON
# under $OUT (or /tmp/strata-gpu), a summary last. Exit status: 1 if any test
# failed.
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=$(realpath "${1:-build/gpu-bundle}")
out=${OUT:-/tmp/strata-gpu}
mkdir -p "$out"
# NCCL from the toolkit, else the one Python's nvidia-nccl package brings.
nccl=""
for dir in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu; do
  [[ -e "$dir/libnccl.so.2" ]] && nccl=$dir && break
done
if [[ -z "$nccl" ]]; then
  nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
fi
export LD_LIBRARY_PATH="$bundle/lib${nccl:+:$nccl}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export STRATA_TEST_DIR="$out/scratch"
mkdir -p "$STRATA_TEST_DIR"
(nvidia-smi -L || echo "no nvidia-smi") > "$out/gpu.txt" 2>&1
echo "NCCL from: ${nccl:-not found}" >> "$out/gpu.txt"
status=0
summary=""
for test in "$bundle"/tests/*; do
  name=$(basename "$test")
  if "$test" > "$out/$name.log" 2>&1; then result=passed; else result=FAILED; status=1; fi
  summary+="$name: $result ($(grep -c '^\[       OK \]' "$out/$name.log") ok, $(grep -c '^\[  SKIPPED \]' "$out/$name.log") skipped lines, $(grep -c '^\[  FAILED  \]' "$out/$name.log") failed lines)"$'\n'
done
strata="$bundle/bin/strata"
"$strata" bench comm --backend nccl --sizes 1MiB,4MiB,16MiB,64MiB,256MiB --iterations 50 \
  --json "$out/bench-comm-nccl.json" > "$out/bench-comm-nccl.txt" 2>&1 || status=1
"$strata" bench comm --backend nccl --host-buffers --sizes 1MiB,4MiB,16MiB,64MiB,256MiB --iterations 50 \
  --json "$out/bench-comm-nccl-host.json" > "$out/bench-comm-nccl-host.txt" 2>&1 || status=1
"$strata" bench io --dir "$out/scratch" --dest device --device-backend cuda --json "$out/bench-io-device.json" \
  > "$out/bench-io-device.txt" 2>&1 || status=1
# The CPU optimizer on the GPU machine's host, every core, against its bandwidth bound (issue 24: bf16 >= 0.85).
for dtype in fp32 bf16; do
  "$strata" bench optim --dtype $dtype --params 256M --json "$out/bench-optim-$dtype.json" \
    > "$out/bench-optim-$dtype.txt" 2>&1 || status=1
done
if [[ -d "$bundle/python/strata" ]]; then  # the adapter against plain PyTorch (gpu_bundle.sh's PYTHON_BUILD)
  PYTHONPATH="$bundle/python" python3 scripts/gpu_adapter_check.py --json "$out/adapter.json" \
    > "$out/adapter.txt" 2>&1 || status=1
  # The adapter's own cost a module on the GPU, and where it goes (200 modules of next to no compute).
  PYTHONPATH="$bundle/python" python3 benchmarks/adapter_cost.py --device cuda --profile 25 \
    --json "$out/adapter-cost.json" > "$out/adapter-cost.txt" 2>&1 || status=1
  # Issue 24's figures: plain PyTorch and strata's three configurations, the last two also with
  # optimizer.overlap (a GPT of 0.2B parameters, bf16).
  PYTHONPATH="$bundle/python" python3 benchmarks/train_bench.py --device cuda --layers 12 --hidden 1024 \
    --heads 16 --vocab 32000 --seq 512 --batch 8 --precision bf16 --steps 6 --peak-tflops 989 \
    --nvme-dir "$out/scratch" --json "$out/train-bench.json" > "$out/train-bench.txt" 2>&1 || status=1
  # And issue 24's own shape: a Hugging Face Llama of 0.94B parameters (4 x 2048 tokens a step), everything on
  # the device and parameters streamed (about 100 s on an H100).
  PYTHONPATH="$bundle/python" python3 benchmarks/train_bench.py --device cuda --model llama --layers 16 \
    --hidden 2048 --heads 16 --vocab 32000 --seq 2048 --batch 4 --precision bf16 --steps 5 --configs fits,streamed,streamed+overlap \
    --peak-tflops 989 --json "$out/train-bench-llama.json" > "$out/train-bench-llama.txt" 2>&1 || status=1
  # Issue 25 on the GPU: a Hugging Face Llama of 0.2B parameters, the device at half its parameters, a step of 1
  # and 8 micro-batches of 2 x 1024 tokens in both orders (the held inputs on the host for the layered ones).
  PYTHONPATH="$bundle/python" python3 benchmarks/accumulation_bench.py --device cuda --model llama --layers 12 \
    --hidden 1024 --heads 16 --vocab 32000 --seq 1024 --batch 2 --precision bf16 --micro-batches 1,8 \
    --offload 2GiB --json "$out/accumulation-bench.json" > "$out/accumulation-bench.txt" 2>&1 || status=1
fi
cat "$out/gpu.txt"
printf '%s' "$summary"
cat "$out/bench-comm-nccl.txt" "$out/bench-comm-nccl-host.txt"
tail -n 12 "$out/bench-io-device.txt"
tail -n 4 "$out/bench-optim-fp32.txt" "$out/bench-optim-bf16.txt"
[[ -f "$out/adapter.txt" ]] && tail -n 30 "$out/adapter.txt"
[[ -f "$out/adapter-cost.txt" ]] && head -n 1 "$out/adapter-cost.txt"
[[ -f "$out/train-bench.txt" ]] && tail -n 10 "$out/train-bench.txt"
[[ -f "$out/train-bench-llama.txt" ]] && tail -n 6 "$out/train-bench-llama.txt"
[[ -f "$out/accumulation-bench.txt" ]] && tail -n 6 "$out/accumulation-bench.txt"
exit $status
