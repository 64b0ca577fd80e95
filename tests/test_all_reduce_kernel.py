"""The fused all-reduce + residual add + RMSNorm kernel (nanoinfer.kernels.all_reduce) on one
device, playing rank 0 of a group whose peers have already arrived: their partial rows sit
in their buffers and their flags are raised in rank 0's flag array. Checks the math against
the PyTorch path (all-reduce, then `add_rms_norm`) and the flag protocol: rank 0 takes its
peers' flags and raises its own in theirs. Two real GPUs: tests/gpu/test_tp_gpu.py.

On CPU the kernel runs in Triton's interpreter, in a child pytest (tests/triton_child.py);
the interpreter mishandles bfloat16 behind raw pointers, so bfloat16 runs on the GPU only.
"""

from __future__ import annotations

import pytest
import torch
from triton_child import interpreter_child, kernel_test

from nanoinfer.layers.layernorm import rms_norm_math

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
MAX_ROWS = 8

test_cpu_interpreter_child = interpreter_child(__file__)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("rows,hidden,slot", [(1, 64, 0), (3, 96, 1), (MAX_ROWS, 200, 1)])
def test_rank0_with_peers_arrived(dtype: torch.dtype, world: int, rows: int, hidden: int, slot: int) -> None:
    from nanoinfer.kernels.all_reduce import FusedAllReduce

    torch.manual_seed(rows * hidden + world)
    buffers = [torch.zeros(FusedAllReduce.SLOTS, MAX_ROWS, hidden, dtype=dtype, device=DEVICE) for _ in range(world)]
    flags = [torch.zeros(MAX_ROWS, world, dtype=torch.int32, device=DEVICE) for _ in range(world)]
    partials = [torch.randn(rows, hidden, device=DEVICE).to(dtype) for _ in range(world)]
    for peer in range(1, world):
        buffers[peer][slot, :rows] = partials[peer]
        flags[0][:rows, peer] = 1
    residual = torch.randn(rows, hidden, device=DEVICE).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    kernel = FusedAllReduce(buffers, flags, 0, MAX_ROWS, hidden)
    assert kernel.fits(partials[0]) and not kernel.fits(torch.zeros(MAX_ROWS + 1, hidden, dtype=dtype))

    out, residual_out = kernel(partials[0], residual, weight, 1e-6, slot)

    summed = sum(p.float() for p in partials).to(dtype)  # what an all-reduce hands back
    want_residual = summed + residual
    assert torch.equal(residual_out, want_residual)
    torch.testing.assert_close(out, rms_norm_math(want_residual, weight, 1e-6), rtol=1e-2 if dtype != torch.float32 else 1e-5,
                               atol=1e-2 if dtype != torch.float32 else 1e-5)
    assert torch.equal(buffers[0][slot, :rows], partials[0])  # our row, for the peers to read
    assert not buffers[0][1 - slot].any()  # the other slot is untouched
    assert not flags[0].any()  # the peers' flags, taken
    for peer in range(1, world):
        assert flags[peer][:rows, 0].eq(1).all() and not flags[peer][rows:].any()  # ours, raised
