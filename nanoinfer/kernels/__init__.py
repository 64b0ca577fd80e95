"""Our Triton kernels. `num_sms` is shared by the launch heuristics that size grids to the GPU;
`arrival_counters` by the kernels whose split programs merge their results in the last one to
arrive (split-K matmul, split-KV attention) instead of in a second kernel; `pdl_enabled` by every
decode kernel that launches with programmatic dependent launch; `INTERPRETER` by the matmul kernels, whose bf16
dots must run in float32 in Triton's CPU interpreter (Triton 3.9's multiplies bf16 operands as their raw uint16
bits)."""

from __future__ import annotations

import functools
import os

import torch

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"

@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors a launch can fill; the CPU interpreter has none to fill (1)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []
_MIN_COUNTERS = 4096


def arrival_counters(device: torch.device, needed: int) -> torch.Tensor:
    """The device's persistent int32 arrival counters, all zero between launches: a split
    launch's programs each add 1 to their tile's counter, and the last to arrive merges the
    splits and resets it to 0. Allocated on first use, which must come before CUDA-graph
    capture (the eager warm-up does it); launches that share them must be stream-ordered
    (the engine runs one stream)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split kernels' arrival counters must be allocated before CUDA-graph capture "
                               "(run the same shapes eagerly first)")
        if buf is not None:
            _RETIRED_COUNTERS.append(buf)  # captured graphs may still point at it: never free
        buf = torch.zeros(max(_MIN_COUNTERS, needed), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


@functools.cache
def pdl_enabled(device: torch.device) -> bool:
    """Whether our kernels launch with programmatic dependent launch (PDL, Hopper and newer): the next
    kernel in the stream is scheduled while this one finishes, and waits (`gdc_wait`) only before it
    touches memory an earlier kernel wrote, so launch latency and ramp-up overlap the previous kernel's
    tail. Every kernel of ours lets its dependents launch only after its own wait, so a kernel that starts
    finds every kernel before its immediate predecessor finished: what those wrote may be read before the
    wait (the deferred norm's residual row, two kernels back, is). Off on the CPU interpreter, older GPUs,
    or with NANOINFER_PDL=0."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("NANOINFER_PDL") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9
