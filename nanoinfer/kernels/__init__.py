"""Our Triton kernels. `num_sms` is shared by the launch heuristics that size grids to the GPU."""

from __future__ import annotations

import functools

import torch


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors a launch can fill; the CPU interpreter has none to fill (1)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
