#!/usr/bin/env bash
# Everything the GPU issue needs, in one device call: GPU tests, then the
# throughput and latency benchmarks. Logs go to $OUT when it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/nanoinfer-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 NANOINFER_COMMIT=${NANOINFER_COMMIT:-unknown}
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
what=${1:-all}
if [ "$what" = all ] || [ "$what" = tests ]; then
  python3 -m pytest -m gpu tests/gpu -q -x -p no:cacheprovider -s 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  python3 bench/throughput.py --max-model-len 2048 --no-tqdm --json-out "$OUT/results.jsonl" ${THROUGHPUT_ARGS:-} 2>&1 | tee "$OUT/throughput.log" | grep -v "^\s*$" | tail -5
  python3 bench/latency.py --max-model-len 2048 --json-out "$OUT/results.jsonl" 2>&1 | tee "$OUT/latency.log" | tail -3
fi
