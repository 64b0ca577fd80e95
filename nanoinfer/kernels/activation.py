"""SiLU-and-mul (the gated MLP's activation) as one Triton kernel: out = silu(gate) * up
for x = [gate | up] of shape [T, 2d].

Why not torch.compile: besides its host cost in eager steps (50-90 us per call on
our H200 machines against 26-43 for this kernel's launch, see kernels/rms_norm.py),
inductor's kernel for this took 91-96 us at 8,192 tokens x 3,072 outputs (1.6 TB/s),
where the bytes allow ~36; this one takes 37 (bench/RESULTS.md). Here a program owns a BLOCK-wide column
tile of one row.

The math is the PyTorch path's (`F.silu(gate) * up`), rounding included: silu is
computed in float32 and rounded to the input dtype before the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoinfer.kernels import pdl_enabled

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dtype = out_ptr.dtype.element_ty
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x comes from the previous kernel
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + row * d + cols, (silu * up).to(dtype), mask=mask)


def supports(x: torch.Tensor) -> bool:
    """Whether `silu_and_mul` takes x (else the caller runs the PyTorch math): 2-D, an even last dim
    with unit stride, a floating dtype the kernel handles."""
    return x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1 and x.dtype in SUPPORTED_DTYPES


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2d] (gate then up) -> silu(gate) * up [T, d] in x's dtype."""
    if not supports(x):
        raise ValueError(f"silu_and_mul kernel: unsupported x {tuple(x.shape)} {x.dtype} stride {x.stride()}")
    num_rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_rows, d), dtype=x.dtype, device=x.device)
    if num_rows and d:
        block = min(_BLOCK, triton.next_power_of_2(d))
        pdl = pdl_enabled(x.device)
        _silu_and_mul_kernel[(num_rows, triton.cdiv(d, block))](
            x, out, d, x.stride(0), BLOCK=block, USE_PDL=pdl, num_warps=max(1, min(4, block // 256)), launch_pdl=pdl,
        )
    return out
