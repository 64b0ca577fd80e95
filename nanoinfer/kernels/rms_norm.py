"""RMSNorm, with the residual add in front of it, as one Triton kernel.

Each decoder layer runs two of these ("add the sublayer's output to the residual
stream, then normalise"), so a step runs 2 x num_layers + 1 of them. In CUDA graphs
any fused kernel does; in eager steps (prefill and mixed prefill + decode) the
host time of the call is what counts, and a torch.compile'd function cost
75-130 us of host time per call on our H200 machines (its guards and wrappers)
where this kernel's launch costs 40-60: at 57 calls per step that was ~6 ms of
a mixed step's host time (bench/RESULTS.md).

One program per row, the whole row in registers (hidden sizes up to 16k). The
math is the PyTorch path's (`layers/layernorm.py: rms_norm_math`), rounding
included: the sum is rounded to the input dtype, the statistics are float32,
the normalised row is rounded to the input dtype before the weight multiplies it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoinfer.kernels import pdl_enabled

_MAX_COLS = 16384
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    n_cols,
    stride_x,
    stride_r,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x (and the residual) come from earlier kernels
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * n_cols + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = ((x32 * inv_rms).to(dtype).to(tl.float32) * w.to(tl.float32)).to(dtype)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + row * n_cols + cols, y, mask=mask)


def supports(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Whether `rms_norm` takes these (else the caller runs the PyTorch math): rows of a 2-D x with a
    unit last stride, the weight (and residual) in x's dtype and shape."""
    return (x.dim() == 2 and x.stride(1) == 1 and x.dtype in SUPPORTED_DTYPES and 1 <= x.shape[1] <= _MAX_COLS
            and weight.shape == (x.shape[1],) and weight.dtype == x.dtype and weight.stride(0) == 1
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.stride(1) == 1)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x) * weight over the last dim of x [T, H]; given a residual, RMSNorm(x + residual)
    and also x + residual: returns (normalised, sum) then."""
    if not supports(x, weight, residual):
        raise ValueError(f"rms_norm kernel: unsupported x {tuple(x.shape)} {x.dtype} stride {x.stride()}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}, residual "
                         f"{None if residual is None else (tuple(residual.shape), residual.dtype)}")
    num_rows, n_cols = x.shape
    out = torch.empty((num_rows, n_cols), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else out
    if num_rows:
        block = triton.next_power_of_2(n_cols)
        pdl = pdl_enabled(x.device)
        _rms_norm_kernel[(num_rows,)](
            x, residual if residual is not None else x, weight, out, summed, n_cols, x.stride(0),
            residual.stride(0) if residual is not None else 0, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, USE_PDL=pdl,
            num_warps=max(1, min(8, block // 256)), launch_pdl=pdl,
        )
    return (out, summed) if residual is not None else out
