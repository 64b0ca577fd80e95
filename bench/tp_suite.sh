#!/usr/bin/env bash
# Tensor parallelism on a 2-GPU machine, in one device call: the TP=2 vs TP=1 equality test,
# then single-stream latency of the Qwen3-8B shape at TP=1 and TP=2. Each command has its own
# time limit and is killed with SIGABRT, so `-X faulthandler` prints where every thread was;
# logs go to $OUT unpiped (a pipe would wait for any worker process still holding it open).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/nanoinfer-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:${PYTHONPATH:-} NCCL_DEBUG=${NCCL_DEBUG:-WARN}
nvidia-smi -L
timeout -s ABRT 240 python3 -X faulthandler -m pytest -m gpu tests/gpu/test_tp_gpu.py -q -x -p no:cacheprovider \
  > "$OUT/tp_tests.log" 2>&1; echo "tp tests exit $?"; tail -n 25 "$OUT/tp_tests.log"
for tp in 1 2; do
  timeout -s ABRT 150 python3 -X faulthandler bench/latency.py --model nanoinfer/configs/qwen3-8b.json \
    --max-model-len 2048 --iters 2 --tensor-parallel-size $tp > "$OUT/latency_tp$tp.log" 2>&1
  echo "latency tp=$tp exit $?"; grep -E "RESULT|Error" "$OUT/latency_tp$tp.log" | tail -3
done
