"""A mixture-of-experts model on the GPU: the fused MoE kernels inside CUDA graphs (decode and mixed steps) give
the greedy tokens of the PyTorch reference path (`fused_moe_math`, eager, PyTorch attention).

The model is the Qwen3-30B-A3B shape cut to 4 layers (128 experts of 768, 8 per token), with dummy weights.

Run on a GPU machine: `python -m pytest -m gpu tests/gpu/test_moe_gpu.py`."""

from __future__ import annotations

import json
import os

import pytest
import torch
from greedy_compare import CONFIGS, assert_greedy_close, common_prefix, greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REFERENCE_PATH = dict(attention_backend="torch", enforce_eager=True)


@pytest.fixture(scope="module")
def moe_config(tmp_path_factory) -> str:
    with open(os.path.join(CONFIGS, "qwen3-30b-a3b.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = 4
    path = tmp_path_factory.mktemp("moe") / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def reference_greedy(config: str, monkeypatch, **engine_args) -> list:
    """The PyTorch path: eager, PyTorch attention, and the experts' plain math instead of the fused kernels."""
    import nanoinfer.layers.moe as moe

    with monkeypatch.context() as patch:
        patch.setattr(moe, "_kernel_device", lambda x: False)
        return greedy(config, load_format="dummy", **REFERENCE_PATH, **engine_args)


def test_moe_fast_path_equals_the_reference_path_fp32(moe_config: str, monkeypatch) -> None:
    reference = reference_greedy(moe_config, monkeypatch, dtype="float32")
    assert_greedy_close(reference, greedy(moe_config, load_format="dummy", dtype="float32"))
    # Small steps: prompts prefill in chunks beside decodes, every step a graph replay.
    assert_greedy_close(reference, greedy(moe_config, load_format="dummy", dtype="float32",
                                          max_num_batched_tokens=256))


def test_moe_fast_path_bf16_tracks_fp32_like_the_reference_path(moe_config: str, monkeypatch) -> None:
    fp32 = reference_greedy(moe_config, monkeypatch, dtype="float32")
    reference = reference_greedy(moe_config, monkeypatch, dtype="bfloat16")
    fast = greedy(moe_config, load_format="dummy", dtype="bfloat16")
    fast_prefix, reference_prefix = common_prefix(fp32, fast), common_prefix(fp32, reference)
    print(f"bf16 tokens equal to fp32's (mean of 32, of 64): fast path {fast_prefix:.1f}, "
          f"reference path {reference_prefix:.1f}")
    assert fast_prefix >= 0.7 * reference_prefix


def test_moe_fp8_experts_equal_the_reference_path_fp32(moe_config: str, monkeypatch) -> None:
    """quantization="fp8": the grouped GEMM on fp8 experts (converted as loaded, row scales in the epilogue) inside
    the graphs gives the PyTorch path's tokens on the same fp8 weights."""
    reference = reference_greedy(moe_config, monkeypatch, dtype="float32", quantization="fp8")
    assert_greedy_close(reference, greedy(moe_config, load_format="dummy", dtype="float32", quantization="fp8"))
