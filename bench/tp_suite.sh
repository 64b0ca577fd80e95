#!/usr/bin/env bash
# Tensor parallelism on a 2-GPU machine, in one device call: the TP=2 vs TP=1 equality test,
# then single-stream latency of the Qwen3-8B shape at TP=1 and TP=2.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi -L
python3 -m pytest -m gpu tests/gpu/test_tp_gpu.py -q -x -p no:cacheprovider 2>&1 | tail -4
for tp in 1 2; do
  python3 bench/latency.py --model nanoinfer/configs/qwen3-8b.json --max-model-len 2048 --iters 2 \
    --tensor-parallel-size $tp 2>&1 | grep -E "RESULT|Error|error" | tail -3
done
