#!/usr/bin/env bash
#   bash bench/tp_suite.sh [all|tests|bench|bench1|bench2]   (bench1/bench2: the TP=1 or TP=2 figures only)
# Tensor parallelism on a 2-GPU machine, in one device call: the TP=2 vs TP=1 equality tests
# (Qwen3-0.6B and Qwen3-8B shapes), then the reference workload and single-stream latency of the
# Qwen3-8B shape at TP=1 (both on their own GPU, at the same time) and at TP=2. Each command has
# its own time limit; pytest-timeout and faulthandler print where every thread was if one hangs.
# Logs go to $OUT unpiped (a pipe would wait for any worker process still holding it open).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/nanoinfer-out}; mkdir -p "$OUT"
ulimit -c 0  # no core files: dumping a CUDA process's address space takes minutes
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:${PYTHONPATH:-} NCCL_DEBUG=${NCCL_DEBUG:-WARN} NANOINFER_COMMIT=${NANOINFER_COMMIT:-unknown}
nvidia-smi -L
what=${1:-all}
run() {  # run LIMIT_S NAME CMD...: one command under a time limit, log to $OUT/NAME.log
  local limit=$1 name=$2; shift 2
  local t0=$SECONDS
  timeout -s ABRT "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - t0)) s"
  grep -E "RESULT|passed|failed|Error" "$OUT/$name.log" | tail -n 6
}
EIGHT_B=(--model nanoinfer/configs/qwen3-8b.json --max-model-len 2048)
if [ "$what" = all ] || [ "$what" = tests ]; then
  run 400 tp_tests python3 -X faulthandler -m pytest -m gpu tests/gpu/test_tp_gpu.py -v -p no:cacheprovider --timeout 150
fi
if [ "$what" = all ] || [ "$what" = bench ] || [ "$what" = bench1 ]; then
  CUDA_VISIBLE_DEVICES=0 run 200 throughput_tp1 python3 -X faulthandler bench/throughput.py "${EIGHT_B[@]}" --no-tqdm \
    --json-out "$OUT/results.jsonl" &
  CUDA_VISIBLE_DEVICES=1 run 200 latency_tp1 python3 -X faulthandler bench/latency.py "${EIGHT_B[@]}" --iters 2 \
    --json-out "$OUT/results.jsonl"
  wait
fi
if [ "$what" = all ] || [ "$what" = bench ] || [ "$what" = bench2 ]; then
  run 110 latency_tp2 python3 -X faulthandler bench/latency.py "${EIGHT_B[@]}" --iters 2 --tensor-parallel-size 2 \
    --json-out "$OUT/results.jsonl"
  run 150 throughput_tp2 python3 -X faulthandler bench/throughput.py "${EIGHT_B[@]}" --no-tqdm \
    --tensor-parallel-size 2 --json-out "$OUT/results.jsonl"
fi
