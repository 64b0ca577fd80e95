"""RMSNorm as one Triton kernel: the model's final norm, once per step (the decoder's own norms are
folded into the projections after them: `DeferredNorm`, layers/layernorm.py). In CUDA graphs any fused
kernel does; in eager steps (prefill and mixed prefill + decode) the host time of the call is what
counts, and a torch.compile'd function cost 75-130 us of host time per call on our H200 machines (its
guards and wrappers) where this kernel's launch costs 40-60 (bench/RESULTS.md).

One program per row, the whole row in registers (hidden sizes up to 16k). The
math is the PyTorch path's (`layers/layernorm.py: rms_norm_math`), rounding
included: the statistics are float32, the normalised row is rounded to the input dtype before the weight multiplies it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoinfer.kernels import pdl_enabled

_MAX_COLS = 16384
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, n_cols, stride_x, eps, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x comes from an earlier kernel
    x32 = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = ((x32 * inv_rms).to(dtype).to(tl.float32) * w.to(tl.float32)).to(dtype)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + row * n_cols + cols, y, mask=mask)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` takes these (else the caller runs the PyTorch math): rows of a 2-D x with a
    unit last stride, the weight in x's dtype and shape."""
    return (x.dim() == 2 and x.stride(1) == 1 and x.dtype in SUPPORTED_DTYPES and 1 <= x.shape[1] <= _MAX_COLS
            and weight.shape == (x.shape[1],) and weight.dtype == x.dtype and weight.stride(0) == 1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight over the last dim of x [T, H]."""
    if not supports(x, weight):
        raise ValueError(f"rms_norm kernel: unsupported x {tuple(x.shape)} {x.dtype} stride {x.stride()}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    num_rows, n_cols = x.shape
    out = torch.empty((num_rows, n_cols), dtype=x.dtype, device=x.device)
    if num_rows:
        block = triton.next_power_of_2(n_cols)
        pdl = pdl_enabled(x.device)
        _rms_norm_kernel[(num_rows,)](x, weight, out, n_cols, x.stride(0), eps, BLOCK=block, USE_PDL=pdl,
                                      num_warps=max(1, min(8, block // 256)), launch_pdl=pdl)
    return out
