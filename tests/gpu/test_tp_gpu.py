"""Tensor parallelism on two GPUs (NCCL): TP=2 greedy output equals TP=1 for the
Qwen3-0.6B and Qwen3-8B shapes with dummy weights (the same full model for every
TP size), in float32, up to near-ties that another summation order may flip (see
greedy_compare). Run on a machine with two GPUs:
`python -m pytest -m gpu tests/gpu/test_tp_gpu.py`."""

from __future__ import annotations

import os

import pytest
import torch
from greedy_compare import CONFIGS, assert_greedy_close, greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.mark.parametrize("config,tp2_args", [
    ("qwen3-0.6b.json", {"enforce_eager": False}),  # CUDA graphs with all-reduces inside
    ("qwen3-8b.json", {"enforce_eager": True}),  # eager: capturing the 8B shape's graphs takes long
], ids=["qwen3-0.6b", "qwen3-8b"])
def test_tp2_equals_tp1(config: str, tp2_args: dict) -> None:
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"  # inherited by every rank before NCCL starts
    model = os.path.join(CONFIGS, config)
    common = {"load_format": "dummy", "dtype": "float32", "gpu_memory_utilization": 0.6}
    tp1 = greedy(model, enforce_eager=True, **common)
    assert_greedy_close(tp1, greedy(model, tensor_parallel_size=2, **common, **tp2_args))
