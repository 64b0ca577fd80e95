#!/usr/bin/env bash
# Everything the single-GPU issues need, in one device call: GPU tests, the throughput and
# latency benchmarks, and the serving benchmark (500 requests of 512 in / 128 out at 16 req/s and
# all at once). Each command has its own time limit (killed with SIGABRT, so faulthandler shows
# where it was); logs go to $OUT unpiped.
#   bash bench/gpu_suite.sh [all|tests|kernel_tests|bench|serving|profile|kernels|mixes|moe|moe_fp8]
# The serving part needs fastapi, uvicorn, pyzmq and pydantic (carried as wheels on the device
# machine) and a tokenizer folder for the dummy model: TOKENIZER (default .tok, SmolLM2's files): bench/carry.sh
# prepares both, and the embedded model for the SmolLM2 test.
source "$(dirname "$0")/suite_common.sh"
if [ "$what" = all ] || [ "$what" = tests ]; then  # ~3.5-5.5 min on an H200 (each engine captures its mixed-step graphs),
  # ~2-3 more with the fp8 weights' tests (2026-11-29): a call of its own
  run 570 gpu_engine_tests python3 -X faulthandler -m pytest -m gpu tests/gpu/test_engine_gpu.py tests/test_sampler.py \
    -v -s -p no:cacheprovider --timeout 150
fi
if [ "$what" = all ] || [ "$what" = kernel_tests ]; then  # ~6 min on an H200: a call of its own
  run 450 gpu_kernel_tests python3 -X faulthandler -m pytest -m "gpu or not gpu" tests/gpu/test_triton_gpu.py \
    tests/test_triton_kernels.py tests/test_sampling_kernel.py tests/test_skinny_gemm.py tests/test_all_reduce_kernel.py \
    tests/test_lora_kernel.py tests/test_fp8.py -q -p no:cacheprovider \
    --timeout 120 --durations 5
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  run 200 throughput python3 -X faulthandler bench/throughput.py --max-model-len 2048 --no-tqdm --step-stats \
    --json-out "$OUT/results.jsonl" ${THROUGHPUT_ARGS:-}
  run 120 latency python3 -X faulthandler bench/latency.py --max-model-len 2048 --json-out "$OUT/results.jsonl"
fi
if [ "$what" = kernels ]; then  # not part of "all": kernel micro-benchmarks (skinny GEMM vs cuBLAS, attention)
  run 200 kernels_gemm python3 bench/kernels.py --gemm --quick --json "$OUT/kernels_gemm.json"
  run 200 kernels_attention python3 bench/kernels.py --quick --json "$OUT/kernels_attention.json"
fi
if [ "$what" = mixes ]; then  # not part of "all": prefill tiles and fp8 / bf16 decode over the workload's own batches
  run 200 kernels_prefill_mix python3 bench/kernels.py --prefill-mix --kv-cache-dtype fp8 --json "$OUT/prefill_mix.json"
  grep -A10 "prefill over" "$OUT/kernels_prefill_mix.log"
  run 150 kernels_decode_mix_fp8 python3 bench/kernels.py --decode-mix --kv-cache-dtype fp8 --json "$OUT/decode_mix_fp8.json"
  grep -E "step [0-9]+:" "$OUT/kernels_decode_mix_fp8.log" | cut -c1-220
  run 150 kernels_decode_mix_bf16 python3 bench/kernels.py --decode-mix --json "$OUT/decode_mix_bf16.json"
  grep -E "step [0-9]+:" "$OUT/kernels_decode_mix_bf16.log" | cut -c1-220
fi
if [ "$what" = moe ]; then  # not part of "all" (a call of its own, ~7 min): mixture of experts: the fused MoE kernel's
  # tests, the engine's greedy tokens against the PyTorch path (Qwen3-30B-A3B's shape cut to 4 layers), and the
  # full 30B-A3B shape's workload and single stream (dummy weights, 61 GB in bf16)
  run 400 gpu_moe_tests python3 -X faulthandler -m pytest -m "gpu or not gpu" tests/test_moe_kernel.py \
    tests/gpu/test_moe_gpu.py -v -s -p no:cacheprovider --timeout 300 --durations 5
  run 150 moe_kernel python3 bench/moe_kernel.py --json "$OUT/moe_kernel.json"
  grep -A10 "fused MoE, one" "$OUT/moe_kernel.log"
  run 300 moe_throughput python3 -X faulthandler bench/throughput.py --model nanoinfer/configs/qwen3-30b-a3b.json \
    --max-model-len 2048 --no-tqdm --step-stats --json-out "$OUT/results.jsonl" ${MOE_THROUGHPUT_ARGS:-}
  run 200 moe_latency python3 -X faulthandler bench/latency.py --model nanoinfer/configs/qwen3-30b-a3b.json \
    --max-model-len 2048 --json-out "$OUT/results.jsonl"
fi
if [ "$what" = moe_fp8 ]; then  # not part of "all" (a call of its own, ~5 min: each run quantizes 61 GB of experts
  # at load): the 30B-A3B shape with fp8 weights (`moe` alone took 10 min with these: past a call's limit)
  run 200 moe_latency_fp8 python3 -X faulthandler bench/latency.py --model nanoinfer/configs/qwen3-30b-a3b.json \
    --max-model-len 2048 --quantization fp8 --json-out "$OUT/results.jsonl"
  run 300 moe_throughput_fp8 python3 -X faulthandler bench/throughput.py --model nanoinfer/configs/qwen3-30b-a3b.json \
    --max-model-len 2048 --no-tqdm --step-stats --quantization fp8 --json-out "$OUT/results.jsonl"
fi
if [ "$what" = all ] || [ "$what" = serving ]; then
  serve_and_load serving "$PWD" 16 inf
fi
if [ "$what" = profile ]; then  # not part of "all": where a step's time goes, with Chrome traces in $OUT
  run 150 profile_decode_b1 python3 bench/profile_step.py --max-model-len 2048 --batch 1 --context 128 --steps 50 \
    --trace "$OUT/trace_decode_b1.json"
  run 150 profile_prefill_b1 python3 bench/profile_step.py --max-model-len 2048 --batch 1 --context 128 --prefill \
    --trace "$OUT/trace_prefill_b1.json"
  run 200 profile_decode_b256 python3 bench/profile_step.py --max-model-len 2048 --batch 256 --context 1000
fi
