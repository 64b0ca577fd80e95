"""torch.compile for the small elementwise pieces of a step (add + RMSNorm,
rotary on the PyTorch attention path, SiLU-and-mul): on a GPU each becomes one fused
kernel instead of five to ten small ones, which at decode batch sizes cost
more in fixed per-kernel time than in bytes. The model runner turns fusion on
for CUDA unless `enforce_eager`; CPU runs stay eager (compiling would cost
more than it saves, and CI runs on CPU)."""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)
_enabled = False


def set_fusion(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def fused(fn: F) -> F:
    """Run `fn` compiled when fusion is on, as plain PyTorch otherwise (same math)."""
    compiled = torch.compile(fn, dynamic=True)

    @functools.wraps(fn)
    def run(*args):
        return compiled(*args) if _enabled else fn(*args)

    return run  # type: ignore[return-value]
