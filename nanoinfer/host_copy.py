"""Host -> device copies that never wait for the device.

A plain copy from pageable memory synchronises the stream, which would undo
async scheduling; a copy from pinned memory does not. Pinning a buffer and
launching a copy each cost tens of microseconds of host time, so a step's
inputs (token ids, positions, slot mapping, block tables, ...) travel together:
packed into one pinned buffer, one copy, then sliced into typed views on the
device."""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 16  # bytes: every packed array starts aligned for any element type
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32}


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One host tensor to `device` without waiting for the device."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def to_device_many(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """numpy arrays (int64, int32 or float32) -> device tensors of the same dtypes and shapes,
    in one pinned buffer and one copy."""
    for array in arrays:
        if array.dtype not in _TORCH_DTYPES:
            raise TypeError(f"to_device_many takes int64, int32 or float32 arrays, got {array.dtype}")
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in arrays]
    offsets, total = [], 0
    for array in arrays:
        offsets.append(total)
        total += -(-array.nbytes // _ALIGN) * _ALIGN
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=True)
    staging = host.numpy()
    for array, offset in zip(arrays, offsets):
        staging[offset : offset + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    packed = host.to(device, non_blocking=True)
    return [packed[offset : offset + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
            for a, offset in zip(arrays, offsets)]
