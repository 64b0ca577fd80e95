"""Tensor parallelism on two GPUs (NCCL): TP=2 greedy output equals TP=1 for the
Qwen3-0.6B and Qwen3-8B shapes with dummy weights (the same full model for every
TP size), in float32, up to near-ties that another summation order may flip (see
greedy_compare). Run on a machine with two GPUs:
`python -m pytest -m gpu tests/gpu/test_tp_gpu.py`."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from greedy_compare import CONFIGS, assert_greedy_close, greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.mark.parametrize("config,tp2_args", [
    ("qwen3-0.6b.json", {"enforce_eager": False}),  # CUDA graphs with all-reduces inside
    ("qwen3-0.6b.json", {"enforce_eager": True}),
    ("qwen3-0.6b.json", {"enforce_eager": True, "async_scheduling": False}),
    ("qwen3-8b.json", {"enforce_eager": True}),  # eager: capturing the 8B shape's graphs takes long
], ids=["qwen3-0.6b-graphs", "qwen3-0.6b-eager", "qwen3-0.6b-eager-sync", "qwen3-8b-eager"])
def test_tp2_equals_tp1(config: str, tp2_args: dict) -> None:
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"  # inherited by every rank before NCCL starts
    assert_greedy_close(tp1_outputs(config), greedy(os.path.join(CONFIGS, config), tensor_parallel_size=2,
                                                   **COMMON, **tp2_args))


COMMON = {"load_format": "dummy", "dtype": "float32", "gpu_memory_utilization": 0.6}


@functools.cache
def tp1_outputs(config: str) -> list:
    return greedy(os.path.join(CONFIGS, config), enforce_eager=True, **COMMON)
