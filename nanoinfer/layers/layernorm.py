"""RMSNorm that can also add the residual stream first, so each decoder layer
does add+norm in one call and keeps the updated residual (nano-vLLM style).

Under tensor parallelism the norms on the residual stream also do its all-reduce
(`all_reduce_slot`): the layer before hands over its partial output and the sum,
the residual add and the norm run as one kernel on GPUs that allow it."""

from __future__ import annotations

import torch
from torch import nn

from nanoinfer.distributed.parallel_state import fused_all_reduce, tp_all_reduce, tp_world_size
from nanoinfer.layers.fusion import use_kernels


def rms_norm_math(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Statistics in float32; the scale is applied in the input dtype, as HF does. Plain
    PyTorch: the CPU path, and the reference of the fused kernel (kernels/rms_norm.py)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_math`, as one Triton kernel where fusion is on."""
    if use_kernels(x):
        from nanoinfer.kernels import rms_norm as kernel  # triton: GPU (or interpreter) only

        if kernel.supports(x, weight):
            return kernel.rms_norm(x, weight, eps)
    return rms_norm_math(x, weight, eps)


def add_rms_norm_math(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) in plain PyTorch, as `rms_norm_math`."""
    x = x + residual
    return rms_norm_math(x, weight, eps), x


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm_math`, as one Triton kernel where fusion is on."""
    if use_kernels(x):
        from nanoinfer.kernels import rms_norm as kernel

        if kernel.supports(x, weight, residual):
            return kernel.rms_norm(x, weight, eps, residual)
    return add_rms_norm_math(x, residual, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, all_reduce_slot: int | None = None) -> None:
        """all_reduce_slot: given, this norm sits on the residual stream after a layer whose output
        is a partial sum over the TP ranks (row-parallel, or the vocab-parallel embedding): it sums
        it first, fused with the add and the norm on GPUs that allow it. Consecutive such norms
        must use different slots (the fused kernel's buffering, see nanoinfer.kernels.all_reduce)."""
        super().__init__()
        self.eps = eps
        self.all_reduce_slot = all_reduce_slot
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise `x` over the last dim. Norms on the residual stream (given a residual, or an
        all_reduce_slot) return (normalised, new residual stream = x + residual, x when None)."""
        if self.all_reduce_slot is not None and tp_world_size() > 1:
            kernel = fused_all_reduce()
            if kernel is not None and kernel.fits(x):
                return kernel(x, residual, self.weight, self.eps, self.all_reduce_slot)
            x = tp_all_reduce(x)
        if residual is not None:
            return add_rms_norm(x, residual, self.weight, self.eps)
        normed = rms_norm(x, self.weight, self.eps)
        return normed if self.all_reduce_slot is None else (normed, x)
