"""Tensor parallelism on two GPUs (NCCL): TP=2 greedy output equals TP=1 for
the Qwen3-0.6B shape with dummy weights, which are the same full model for
every TP size. Run on a machine with two GPUs:
`python -m pytest -m gpu tests/gpu/test_tp_gpu.py`."""

from __future__ import annotations

import gc
import os
import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "nanoinfer", "configs", "qwen3-0.6b.json")


def prompts(n: int = 32) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randint(0, 10000) for _ in range(rng.randint(5, 300))] for _ in range(n)]


def greedy_tokens(**engine_args) -> list[list[int]]:
    from nanoinfer import LLM, SamplingParams

    llm = LLM(CONFIG, load_format="dummy", dtype="float32", max_model_len=2048, gpu_memory_utilization=0.4,
              **engine_args)
    try:
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]
    finally:
        llm.engine.core.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def tp1_tokens() -> list[list[int]]:
    return greedy_tokens()


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda_graphs", "eager"])
def test_tp2_equals_tp1_dummy_qwen3_0_6b(tp1_tokens, enforce_eager: bool) -> None:
    tokens = greedy_tokens(tensor_parallel_size=2, enforce_eager=enforce_eager)
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"  # set for every rank before NCCL starts
    assert tokens == tp1_tokens
