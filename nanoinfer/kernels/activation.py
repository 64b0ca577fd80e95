"""SiLU-and-mul (the gated MLP's activation) as one Triton kernel: out = silu(gate) * up
for x = [gate | up] of shape [T, 2d], the gate/up projection of the un-normalised residual
stream: the MLP's input RMSNorm has its weight folded into that projection and its r (and the
projection's bias) applied here (`DeferredNorm`, kernels/deferred_norm.py), so it needs no kernel
of its own. Each program reads its token's residual row for r.

Why not torch.compile: besides its host cost in eager steps (50-90 us per call on
our H200 machines against 26-43 for this kernel's launch, see kernels/rms_norm.py),
inductor's kernel for this took 91-96 us at 8,192 tokens x 3,072 outputs (1.6 TB/s),
where the bytes allow ~36; this one takes 37 (bench/RESULTS.md). Here a program owns a BLOCK-wide column
tile of one row.

The math is the PyTorch path's (`silu_and_mul_math`), rounding included: gate and up are
scaled and biased in float32 and rounded to the input dtype, silu is computed in float32 and
rounded before the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoinfer.kernels import pdl_enabled
from nanoinfer.kernels.deferred_norm import bias_fits, block_hidden, hidden_fits, rms_scaled, row_rms_scale

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, hidden_ptr, bias_ptr, out_ptr, d, n_hidden, stride_x, stride_h, eps,
                         HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dtype = out_ptr.dtype.element_ty
    # Before the wait, off the critical path: the residual row was written two kernels back (`pdl_enabled`).
    r = row_rms_scale(hidden_ptr + row * stride_h, n_hidden, eps, BLOCK_H)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x comes from the previous kernel
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    gate = rms_scaled(gate, r, bias_ptr, cols, mask, dtype, HAS_BIAS).to(tl.float32)
    up = rms_scaled(up, r, bias_ptr, d + cols, mask, dtype, HAS_BIAS).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + row * d + cols, (silu * up).to(dtype), mask=mask)


def supports(x: torch.Tensor, hidden: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `silu_and_mul` takes these (else the caller runs the PyTorch math): 2-D x, an even last dim
    with unit stride, a floating dtype the kernel handles; hidden and bias as `hidden_fits`, `bias_fits`."""
    return (x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1 and x.dtype in SUPPORTED_DTYPES
            and hidden_fits(x, hidden) and bias_fits(bias, x.shape[1]))


def silu_and_mul(x: torch.Tensor, hidden: torch.Tensor, eps: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2d] (gate then up), from the residual stream rows hidden [T, H] -> silu(gate') * up' [T, d] in
    x's dtype, where [gate' | up'] = x * rsqrt(mean(hidden^2) + eps) + bias per row."""
    if not supports(x, hidden, bias):
        raise ValueError(f"silu_and_mul kernel: unsupported x {tuple(x.shape)} {x.dtype} stride {x.stride()}, hidden "
                         f"{tuple(hidden.shape)} {hidden.dtype} stride {hidden.stride()}, bias "
                         f"{None if bias is None else (tuple(bias.shape), bias.dtype)}")
    num_rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_rows, d), dtype=x.dtype, device=x.device)
    if num_rows and d:
        block = min(_BLOCK, triton.next_power_of_2(d))
        pdl = pdl_enabled(x.device)
        _silu_and_mul_kernel[(num_rows, triton.cdiv(d, block))](
            x, hidden, x if bias is None else bias, out, d, hidden.shape[1], x.stride(0), hidden.stride(0), eps,
            HAS_BIAS=bias is not None, BLOCK=block, BLOCK_H=block_hidden(hidden), USE_PDL=pdl,
            num_warps=max(1, min(4, block // 256)), launch_pdl=pdl,
        )
    return out
