"""Fused kernels for the small elementwise pieces of a step: on a GPU each piece
becomes one kernel instead of five to ten small ones, which at decode batch sizes
cost more in fixed per-kernel time than in bytes. The final RMSNorm and SiLU-and-mul
run our Triton kernels (`use_kernels`: they also cost far less host time per
call than compiled functions, which eager prefill steps pay); rotary on the
PyTorch attention path is torch.compile'd (`fused`). The model runner turns
fusion on for CUDA unless `enforce_eager`; CPU runs stay plain PyTorch (the
layers never import triton there, and CI runs on CPU)."""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)
_enabled = False


def set_fusion(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def _kernel_device(x: torch.Tensor) -> bool:
    """Where the Triton kernels may run (tests widen this to the CPU interpreter)."""
    return x.is_cuda


def use_kernels(x: torch.Tensor) -> bool:
    """Whether fusion is on and x is where our fused Triton kernels run."""
    return _enabled and _kernel_device(x)


def fused(fn: F) -> F:
    """Run `fn` compiled when fusion is on, as plain PyTorch otherwise (same math)."""
    compiled = torch.compile(fn, dynamic=True)

    @functools.wraps(fn)
    def run(*args):
        return compiled(*args) if _enabled else fn(*args)

    return run  # type: ignore[return-value]
