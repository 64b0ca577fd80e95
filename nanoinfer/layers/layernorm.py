"""RMSNorm that can also add the residual stream first, so each decoder layer
does add+norm in one call and keeps the updated residual (nano-vLLM style)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise `x` (or `x + residual`, returned as the new residual) over the last dim.
        The statistics are taken in float32; the scale is applied in the input dtype, as HF does."""
        if residual is not None:
            x = x + residual
            residual = x
        x32 = x.float()
        out = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
        return out if residual is None else (out, residual)
