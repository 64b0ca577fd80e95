"""Which matmul a linear layer runs: `F.linear`, or our skinny Triton kernel
(kernels/skinny_gemm.py) for a decode-sized batch where the start-up tuning
found it faster than cuBLAS for that weight shape. Kept apart from the kernel
so that the layers, and CPU runs, never import triton."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

MAX_M = 16  # rows the skinny kernel takes
_enabled = False
# (M bucket, N, K, dtype) -> the skinny kernel's launch config (a SkinnyConfig) where it beat
# cuBLAS, None where cuBLAS won. Filled on CUDA by `tune_skinny_gemm`.
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
    return _choices.get((m_bucket(x.shape[0]), weight.shape[0], weight.shape[1], x.dtype))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, or the skinny kernel where the start-up tuning found it faster.

    With `residual` (a row-parallel layer adding into the residual stream): `residual` is updated in
    place to residual + x @ weight^T (+ bias) and returned: in the skinny kernel's epilogue, else by
    cuBLAS's beta=1 (`addmm_`). The tuning's choice for the plain product stands for both."""
    config = skinny_config(x, weight)
    if config is not None:
        from nanoinfer.kernels import skinny_gemm  # only reached on CUDA, after tuning

        return skinny_gemm.skinny_linear(x, weight, bias, residual=residual, config=config)
    if residual is None:
        return F.linear(x, weight, bias)
    residual.addmm_(x, weight.t())
    return residual if bias is None else residual.add_(bias)
