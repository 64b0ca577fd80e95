#!/usr/bin/env bash
#   bash bench/tp_suite.sh [all|tests|bench|bench1|bench2|profile]   (bench1/bench2: the TP=1 or TP=2 figures only;
#   profile, not part of all: all-reduce latencies (NCCL vs symmetric memory), then the TP=2 single-stream
#   step of rank 0, with a Chrome trace in $OUT)
# Tensor parallelism on a 2-GPU machine, in one device call: the TP=2 vs TP=1 equality tests
# (Qwen3-0.6B and Qwen3-8B shapes), then the reference workload and single-stream latency of the
# Qwen3-8B shape at TP=1 (both on their own GPU, at the same time) and at TP=2. Each command has
# its own time limit; pytest-timeout and faulthandler print where every thread was if one hangs.
source "$(dirname "$0")/suite_common.sh"
EIGHT_B=(--model nanoinfer/configs/qwen3-8b.json --max-model-len 2048)
if [ "$what" = all ] || [ "$what" = tests ]; then
  run 560 tp_tests python3 -X faulthandler -m pytest -m "gpu or not gpu" tests/gpu/test_tp_gpu.py tests/test_all_reduce_kernel.py \
    -v -s --tb=short -p no:cacheprovider --timeout 250
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
if [ "$what" = profile ]; then
  run 90 allreduce python3 bench/allreduce.py --hidden 4096
  cat "$OUT/allreduce.log"
  run 150 profile_tp2 python3 bench/profile_step.py "${EIGHT_B[@]}" --batch 1 --context 128 --steps 50 \
    --tensor-parallel-size 2 --trace "$OUT/trace_tp2_b1.json"
fi
