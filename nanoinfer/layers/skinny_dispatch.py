"""Which matmul a linear layer runs: `F.linear`, or our skinny Triton kernel
(kernels/skinny_gemm.py) for a decode-sized batch where the start-up tuning
found it faster than cuBLAS for that weight shape; and for an MLP's gate_up
projection with its SiLU-and-mul, the two as before or the kernel's gated form
(one kernel) where that was faster. Kept apart from the kernel so that the
layers, and CPU runs, never import triton."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from nanoinfer.layers.activation import silu_and_mul

MAX_M = 16  # rows the skinny kernel takes
_enabled = False
# (M bucket, N, K, dtype) -> the skinny kernel's launch config (a SkinnyConfig) where it beat
# cuBLAS, None where cuBLAS won. Filled on CUDA by `tune_skinny_gemm`.
_choices: dict[tuple[int, int, int, torch.dtype], Any] = {}
# (M bucket, N, K, dtype) -> the gated kernel's config for a [2N, K] gate_up weight where it beat
# `unfused_gated_linear`, None where it did not. Filled on CUDA by `tune_skinny_gemm`.
_gated_choices: dict[tuple[int, int, int, torch.dtype], Any] = {}


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


def _tuned(table: dict, x: torch.Tensor, N: int, K: int) -> Any:
    """`table`'s config for x against an N-output, K-input weight, or None where the kernel may not run."""
    if not _enabled or x.dim() != 2 or not 1 <= x.shape[0] <= MAX_M or not _kernel_device(x):
        return None
    return table.get((m_bucket(x.shape[0]), N, K, x.dtype))


def skinny_config(x: torch.Tensor, weight: torch.Tensor) -> Any:
    """The skinny kernel's config `linear(x, weight, ...)` would run with, or None for `F.linear`."""
    return _tuned(_choices, x, weight.shape[0], weight.shape[1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, or the skinny kernel where the start-up tuning found it faster."""
    config = skinny_config(x, weight)
    if config is not None:
        from nanoinfer.kernels import skinny_gemm  # only reached on CUDA, after tuning

        return skinny_gemm.skinny_linear(x, weight, bias, config=config)
    return F.linear(x, weight, bias)


def unfused_gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`gated_linear` as two kernels: the projection (`linear`), then the compiled SiLU-and-mul."""
    return silu_and_mul(linear(x, weight, bias))


def gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x Wg^T + bg) * (x Wu^T + bu) for weight [Wg; Wu] (gate rows, then up rows): the skinny
    kernel's gated form where the start-up tuning found it faster than `unfused_gated_linear`."""
    config = _tuned(_gated_choices, x, weight.shape[0] // 2, weight.shape[1])
    if config is not None:
        from nanoinfer.kernels import skinny_gemm  # only reached on CUDA, after tuning

        return skinny_gemm.skinny_linear(x, weight, bias, config=config, gated=True)
    return unfused_gated_linear(x, weight, bias)
