"""Which matmul a linear layer runs: `F.linear` (for fp8 weights `fp8_matmul`, layers/fp8.py), or our skinny
Triton kernel (kernels/skinny_gemm.py) for a decode-sized batch where the start-up tuning found it faster for
that weight shape. Kept apart from the kernel so that the layers, and CPU runs, never import triton."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from nanoinfer.layers.fp8 import fp8_matmul

MAX_M = 16  # rows the skinny kernel takes
_enabled = False
# (M bucket, N, K, weight dtype) -> the skinny kernel's launch config (a SkinnyConfig) where it beat
# `dense_linear` (cuBLAS), None where that won. Filled on CUDA by `tune_skinny_gemm`.
_choices: dict[tuple[int, int, int, torch.dtype], Any] = {}


def set_skinny_gemm(enabled: bool) -> None:
    """The model runner turns this on for CUDA without enforce_eager (like `set_fusion`)."""
    global _enabled
    _enabled = enabled


def m_bucket(M: int) -> int:
    """Row counts share a choice per power of two (1, 2, 4, 8, 16)."""
    return 1 << (M - 1).bit_length()


def _kernel_device(x: torch.Tensor) -> bool:
    """Where the kernel may run (tests widen this to the CPU interpreter)."""
    return x.is_cuda


def skinny_config(x: torch.Tensor, weight: torch.Tensor) -> Any:
    """The skinny kernel's config `linear(x, weight, ...)` would run with, or None for `F.linear`."""
    if not _enabled or x.dim() != 2 or not 1 <= x.shape[0] <= MAX_M or not _kernel_device(x):
        return None
    return _choices.get((m_bucket(x.shape[0]), weight.shape[0], weight.shape[1], weight.dtype))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) by the skinny kernel where the start-up tuning found it faster, else `dense_linear`.
    W is `weight`, or with `weight_scale` (fp8 weights) `weight * weight_scale[:, None]`.

    With `residual` (a row-parallel layer adding into the residual stream): `residual` is updated in
    place to residual + x @ W^T (+ bias) and returned. The tuning's choice for the plain product stands for both."""
    config = skinny_config(x, weight)
    if config is not None:
        from nanoinfer.kernels import skinny_gemm  # only reached on CUDA, after tuning

        return skinny_gemm.skinny_linear(x, weight, bias, residual=residual, config=config, weight_scale=weight_scale)
    return dense_linear(x, weight, bias, residual, weight_scale)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` without the skinny kernel: `F.linear` (a residual added by cuBLAS's beta=1, `addmm_`), or for
    fp8 weights `fp8_matmul` followed by the bias and the residual."""
    if weight_scale is not None:
        out = fp8_matmul(x, weight, weight_scale)
        if bias is not None:
            out.add_(bias)
        return out if residual is None else residual.add_(out)
    if residual is None:
        return F.linear(x, weight, bias)
    residual.addmm_(x, weight.t())
    return residual if bias is None else residual.add_(bias)
