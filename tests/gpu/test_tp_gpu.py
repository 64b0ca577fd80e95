"""Tensor parallelism on two GPUs (NCCL): TP=2 greedy output equals TP=1 for the
Qwen3-0.6B and Qwen3-8B shapes with dummy weights (the same full model for every
TP size; scaled so that logits are spread, see `dummy_bounds`), in float32 so that
the all-reduce's other summation order cannot flip a token. Run on a machine with
two GPUs: `python -m pytest -m gpu tests/gpu/test_tp_gpu.py`."""

from __future__ import annotations

import gc
import os
import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "nanoinfer", "configs")


def prompts(n: int = 32) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randint(0, 10000) for _ in range(rng.randint(5, 300))] for _ in range(n)]


def greedy_tokens(config: str, **engine_args) -> list[list[int]]:
    from nanoinfer import LLM, SamplingParams

    llm = LLM(os.path.join(CONFIGS, config), load_format="dummy", dtype="float32", max_model_len=2048,
              gpu_memory_utilization=0.6, **engine_args)
    try:
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]
    finally:
        llm.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("config,tp2_args", [
    ("qwen3-0.6b.json", [{"enforce_eager": False}]),  # CUDA graphs with all-reduces inside
    ("qwen3-8b.json", [{"enforce_eager": True}]),  # eager: capturing the 8B shape's graphs takes long
], ids=["qwen3-0.6b", "qwen3-8b"])
def test_tp2_equals_tp1(config: str, tp2_args: list[dict]) -> None:
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"  # inherited by every rank before NCCL starts
    tp1 = greedy_tokens(config, enforce_eager=True)
    for args in tp2_args:
        assert greedy_tokens(config, tensor_parallel_size=2, **args) == tp1, args
