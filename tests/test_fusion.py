"""The torch.compile'd pieces (rotary on the PyTorch attention path) compute what their
plain PyTorch versions do. (add + RMSNorm and SiLU-and-mul fuse as Triton kernels:
tests/test_fused_kernels.py.)

On the GPU the model runner turns fusion on; here it is compiled with inductor's
CPU backend, which traces and fuses the same graphs, so a function that does not
compile or whose fused math drifts fails on CPU too."""

from __future__ import annotations

import pytest
import torch

from nanoinfer.layers import fusion
from nanoinfer.layers.rotary import RotaryEmbedding, apply_rotary, norm_heads_and_rotate

HEAD_DIM, HEADS, KV_HEADS = 64, 4, 2


def both(fn, *args):
    """(eager result, compiled result) of fn(*args)."""
    fusion.set_fusion(False)
    eager = fn(*args)
    fusion.set_fusion(True)
    try:
        return eager, fn(*args)
    finally:
        fusion.set_fusion(False)


def cases(num_tokens: int):
    g = torch.Generator().manual_seed(num_tokens)
    rope = RotaryEmbedding(HEAD_DIM, 512, {"rope_theta": 10000.0, "rope_type": "default"})
    q, k = torch.randn(num_tokens, HEADS * HEAD_DIM, generator=g), torch.randn(num_tokens, KV_HEADS * HEAD_DIM, generator=g)
    positions = torch.randint(0, 512, (num_tokens,), generator=g)
    head_weight = torch.rand(HEAD_DIM, generator=g) + 0.5
    tables = (rope.cos_cache, rope.sin_cache, HEAD_DIM)
    return [
        (apply_rotary, (positions, q, k, *tables)),
        (norm_heads_and_rotate, (positions, q, k, head_weight, head_weight.flip(0), 1e-6, *tables)),
    ]


@pytest.mark.parametrize("num_tokens", [1, 7])
def test_compiled_equals_eager(num_tokens: int) -> None:
    for fn, args in cases(num_tokens):
        eager, compiled = both(fn, *args)
        eager, compiled = (eager,) if torch.is_tensor(eager) else eager, (compiled,) if torch.is_tensor(compiled) else compiled
        for e, c in zip(eager, compiled, strict=True):
            torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5, msg=lambda m: f"{fn.__name__}: {m}")
