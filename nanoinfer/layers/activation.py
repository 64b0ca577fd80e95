"""Gated activation of the MLP: the fused gate/up projection is split in half
and the SiLU of the gate multiplies the up half. The projection reads the residual
stream as it is (its input RMSNorm's weight folded into it): the norm's r and the
projection's bias are applied here first (`DeferredNorm`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.layers.fusion import use_kernels
from nanoinfer.layers.layernorm import DeferredNorm


def silu_and_mul_math(x: torch.Tensor, norm: DeferredNorm) -> torch.Tensor:
    """Plain PyTorch: the CPU path, and the reference of the fused kernel (kernels/activation.py)."""
    gate, up = norm.apply(x).chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor, norm: DeferredNorm) -> torch.Tensor:
    """silu(gate) * up of norm.apply(x) = [gate | up], as one Triton kernel where fusion is on."""
    if use_kernels(x):
        from nanoinfer.kernels import activation as kernel  # triton: GPU (or interpreter) only

        if kernel.supports(x, norm.hidden, norm.bias):
            return kernel.silu_and_mul(x, norm.hidden, norm.eps, norm.bias)
    return silu_and_mul_math(x, norm)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor, norm: DeferredNorm) -> torch.Tensor:
        """x: [T, 2 * d] (gate then up, before the deferred norm) -> [T, d]."""
        return silu_and_mul(x, norm)
