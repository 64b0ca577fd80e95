"""Tensor-parallel group state. With no process group initialised every helper
acts as a single rank, so the same model code runs with and without TP."""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP group in place (a row-parallel layer's partial outputs)."""
    if tp_world_size() > 1:
        dist.all_reduce(x)
    return x


def tp_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's shard of the last dimension (vocab-parallel logits)."""
    world = tp_world_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
