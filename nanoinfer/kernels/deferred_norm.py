"""The part of a decoder RMSNorm left after its weight was folded into the next matmul (`DeferredNorm`,
layers/layernorm.py), as pieces of the kernels that read that matmul's output (rotate_and_cache for qkv,
SiLU-and-mul for gate_up): r = rsqrt(mean(hidden^2) + eps) from the token's residual stream row, then
x * r + bias in float32, rounded once to the model dtype (`rms_scale_math`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_H = 16384  # a row up to this wide is one load into a program's registers; wider rows go in chunks


@triton.jit
def row_rms_scale(hidden_row_ptr, n_hidden, eps, BLOCK_H: tl.constexpr):
    """r of one residual stream row (unit stride), statistics in float32. Every model we know has a row of
    at most BLOCK_H values (one pass of the loop); a wider one is summed BLOCK_H values at a time."""
    cols = tl.arange(0, BLOCK_H)
    squares = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(0, n_hidden, BLOCK_H):
        # .cg (from L2, not this SM's L1): the kernels read the row before their PDL wait, and the row changes
        # twice a layer, so a line an earlier kernel left in L1 must not serve it.
        h = tl.load(hidden_row_ptr + start + cols, mask=start + cols < n_hidden, other=0.0,
                    cache_modifier=".cg").to(tl.float32)
        squares += h * h
    return tl.rsqrt(tl.sum(squares, axis=0) / n_hidden + eps)


@triton.jit
def rms_scaled(x, r, bias_ptr, offsets, mask, dtype: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Loaded matmul outputs x times r, plus bias[offsets] where HAS_BIAS, in float32, rounded once to dtype."""
    y = x.to(tl.float32) * r
    if HAS_BIAS:
        y += tl.load(bias_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    return y.to(dtype)


def block_hidden(hidden: torch.Tensor) -> int:
    """`row_rms_scale`'s BLOCK_H for these rows."""
    return min(triton.next_power_of_2(hidden.shape[1]), MAX_BLOCK_H)


def hidden_fits(x: torch.Tensor, hidden: torch.Tensor) -> bool:
    """Whether the kernels take `hidden` as the rows behind x [T, n]: [T, H >= 1] in x's dtype, unit last
    stride (any row stride)."""
    return (hidden.dim() == 2 and hidden.shape[0] == x.shape[0] and hidden.shape[1] >= 1
            and hidden.dtype == x.dtype and hidden.stride(1) == 1)


def bias_fits(bias: torch.Tensor | None, width: int) -> bool:
    """Whether the kernels take `bias` for a matmul output `width` wide: none, or contiguous floats of that length."""
    return bias is None or (bias.shape == (width,) and bias.is_contiguous() and bias.is_floating_point())
