"""Gated activation of the MLP: the fused gate/up projection is split in half
and the SiLU of the gate multiplies the up half."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.layers.fusion import use_kernels


def silu_and_mul_math(x: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: the CPU path, and the reference of the fused kernel (kernels/activation.py)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x = [gate | up], as one Triton kernel where fusion is on."""
    if use_kernels(x):
        from nanoinfer.kernels import activation as kernel  # triton: GPU (or interpreter) only

        if kernel.supports(x):
            return kernel.silu_and_mul(x)
    return silu_and_mul_math(x)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, 2 * d] (gate then up) -> [T, d]."""
        return silu_and_mul(x)
