"""Gated activation of the MLP: the fused gate/up projection is split in half
and the SiLU of the gate multiplies the up half."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.layers.fusion import fused


@fused
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, 2 * d] (gate then up) -> [T, d]."""
        return silu_and_mul(x)
