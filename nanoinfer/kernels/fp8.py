"""Per-token fp8 quantization of a matmul's activations (layers/fp8.py's W8A8 path) as one Triton kernel:
each program reads one row twice (its largest magnitude, then the row over its scale), writes the row as
float8_e4m3fn and its float32 scale. In PyTorch the same math is four to six kernels, which at decode batch
sizes cost more in launches than the row's bytes. The math is `quantize_per_token`'s PyTorch path: the
scale is max|x| / 448 (at least MIN_SCALE), x / scale is clamped to +-448 and rounded to nearest; a NaN in a row
makes its scale and every value NaN, an infinity its scale infinite (its own value NaN, the others 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoinfer.kernels import INTERPRETER, pdl_enabled
from nanoinfer.layers.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 2048  # columns per pass of the row loop


@triton.jit
def _round_to_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, in float32 arithmetic.
    Only for Triton's CPU interpreter, whose float32 -> fp8 conversion drops the carry of a rounding that reaches
    the next power of two (124.3 became 64, not 128); a GPU converts in hardware."""
    exponent = tl.floor(tl.log2(tl.maximum(tl.abs(v), 2.0**-6)))  # subnormals share the smallest normal's step
    step = tl.exp2(exponent - 3)  # 3 mantissa bits
    t = v / step
    r = tl.floor(t + 0.5)
    odd = r - 2.0 * tl.floor(r * 0.5) != 0.0
    return tl.where((r - t == 0.5) & odd, r - 1.0, r) * step


@triton.jit
def _quantize_per_token_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, FP8_MAX: tl.constexpr,
                               MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr, ROUND_FIRST: tl.constexpr,
                               USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x comes from the previous kernel
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, K, BLOCK):
        mask = start + offs < K
        x = tl.load(x_ptr + row * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
    row_amax = tl.max(amax, axis=0)  # (a reduction drops NaN: put it back)
    row_amax = tl.where(tl.max((amax != amax).to(tl.int32), axis=0) > 0, float("nan"), row_amax)
    scale = tl.maximum(tl.math.div_rn(row_amax, FP8_MAX), MIN_SCALE, propagate_nan=tl.PropagateNan.ALL)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    for start in range(0, K, BLOCK):
        mask = start + offs < K
        x = tl.load(x_ptr + row * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.math.div_rn(x, scale)  # IEEE divisions (here and for the scale), as PyTorch's
        q = tl.minimum(tl.maximum(q, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                       propagate_nan=tl.PropagateNan.ALL)
        if ROUND_FIRST:
            q = _round_to_e4m3(q)
        tl.store(q_ptr + row * K + start + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) -> (float8_e4m3fn [M, K] contiguous, float32 scales [M, 1])."""
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"quantize_per_token kernel: unsupported x {tuple(x.shape)} {x.dtype} stride {x.stride()}")
    M, K = x.shape
    q = torch.empty((M, K), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M and K:
        block = min(_BLOCK, triton.next_power_of_2(K))
        pdl = pdl_enabled(x.device)
        _quantize_per_token_kernel[(M,)](
            x, q, scale, K, x.stride(0), FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK=block, ROUND_FIRST=INTERPRETER,
            USE_PDL=pdl, num_warps=max(1, min(8, block // 256)), launch_pdl=pdl,
        )
    return q, scale
