"""RMSNorm, and what is left of it once its weight is folded into the next matmul
(`DeferredNorm`): the decoder's norms on the residual stream run no kernel of
their own (layers/linear.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanoinfer.layers.fusion import use_kernels


def rms_norm_math(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Statistics in float32; the scale is applied in the input dtype, as HF does. Plain
    PyTorch: the CPU path, and the reference of the fused kernel (kernels/rms_norm.py)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rms_scale_math(x: torch.Tensor, hidden: torch.Tensor, eps: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Row t of x times rsqrt(mean(hidden[t]^2) + eps), plus bias, in float32, rounded once to x's dtype:
    `DeferredNorm`'s math. Plain PyTorch: the CPU path, and the reference of the kernels that apply it."""
    h32 = hidden.float()
    y = x.float() * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@dataclass(frozen=True)
class DeferredNorm:
    """What is left of an RMSNorm whose weight was folded into the matmul after it.

    RMSNorm(h) @ W^T + b = r * (h @ (W * g)^T) + b, with r = rsqrt(mean(h^2) + eps) per row: so the decoder's
    norms need no kernel of their own. The weight g lives in the next matmul's weight (folded at load time),
    the matmul reads the residual stream h as it is, and the kernel after it (rotate_and_cache, SiLU-and-mul),
    which reads those rows anyway, applies r and the matmul's bias.

    The matmul's output is rounded before r scales it, so it carries the row's RMS: in float16 a residual
    stream of RMS in the thousands times an O(10) normalised projection would pass 65,504 (bfloat16 and
    float32 have the range; the streams of the models we know stay in the tens)."""

    hidden: torch.Tensor  # [T, hidden_size]: the residual stream rows the statistics come from
    eps: float
    bias: torch.Tensor | None = None  # the matmul's bias, added after the scale

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """`rms_scale_math` of the matmul's output x [T, n]."""
        return rms_scale_math(x, self.hidden, self.eps, self.bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_math`, as one Triton kernel where fusion is on."""
    if use_kernels(x):
        from nanoinfer.kernels import rms_norm as kernel  # triton: GPU (or interpreter) only

        if kernel.supports(x, weight):
            return kernel.rms_norm(x, weight, eps)
    return rms_norm_math(x, weight, eps)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim. The decoder's norms on the residual stream hold only their weight
    (folded into the next matmul's at load time) and eps: the kernel after that matmul applies the rest
    (`DeferredNorm`). Run as a module: the final norm, an MoE block's input norm (layers/moe.py), and Qwen3's
    per-head query and key norms."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
