"""The fused all-reduce + residual add kernel (nanoinfer.kernels.all_reduce) on one
device, playing rank 0 of a group whose peers have already arrived: their partial rows sit in
their regions of rank 0's buffers, as epoch-tagged words (few rows) or as rows with their flags in
rank 0's flag array showing this call's epoch (more rows). Checks the math against the PyTorch
path (all-reduce, then `+ residual`), bit for bit, and the protocol: rank 0 pushes its rows into its region
of every peer's buffer, tagged or followed by its flag there, and counts the epochs per slot. Two real GPUs:
tests/gpu/test_tp_gpu.py.

On CPU the kernel runs in Triton's interpreter, in a child pytest (tests/triton_child.py);
the interpreter mishandles bfloat16 behind raw pointers, so bfloat16 runs on the GPU only.
"""

from __future__ import annotations

import pytest
import torch
from triton_child import interpreter_child, kernel_test

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
MAX_ROWS = 8
MAX_PROGRAMS = 4  # below MAX_ROWS, so that 8 rows take two per program
LL_ROWS = 4  # 1 and 3 rows go as flag-carrying words, 8 as rows + flags

test_cpu_interpreter_child = interpreter_child(__file__)


def words(x: torch.Tensor, epoch: int) -> torch.Tensor:
    """Rows as the small-batch path sends them: each element's bits in the low half of an int64,
    the epoch in the high half."""
    bits = x.view(torch.int16 if x.element_size() == 2 else torch.int32).to(torch.int64)
    return (bits & ((1 << (8 * x.element_size())) - 1)) | (epoch << 32)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("rows,hidden,slot,residual", [(1, 64, 0, True), (3, 96, 1, True), (MAX_ROWS, 200, 2, False)])
def test_rank0_with_peers_arrived(monkeypatch, dtype: torch.dtype, world: int, rows: int, hidden: int, slot: int,
                                  residual: bool) -> None:
    from nanoinfer.kernels.all_reduce import FusedAllReduce

    monkeypatch.setattr(FusedAllReduce, "MAX_PROGRAMS", MAX_PROGRAMS)
    monkeypatch.setattr(FusedAllReduce, "LL_ROWS", LL_ROWS)
    slots, ll = FusedAllReduce.SLOTS, rows <= LL_ROWS
    programs = rows if ll else -(-rows // -(-rows // MAX_PROGRAMS))
    buffers = [torch.zeros(slots, world, MAX_ROWS, hidden, dtype=dtype, device=DEVICE) for _ in range(world)]
    ll_buffers = [torch.zeros(slots, world, LL_ROWS, hidden, dtype=torch.int64, device=DEVICE) for _ in range(world)]
    flags = [torch.zeros(slots, MAX_PROGRAMS, world, dtype=torch.int32, device=DEVICE) for _ in range(world)]
    kernel = FusedAllReduce(buffers, ll_buffers, flags, 0, MAX_ROWS, hidden)
    assert not kernel.fits(torch.zeros(MAX_ROWS + 1, hidden, dtype=dtype))

    for epoch in (1, 2):  # the second call checks that the epochs count on
        torch.manual_seed(rows * hidden + world + epoch)
        partials = [torch.randn(rows, hidden, device=DEVICE).to(dtype) for _ in range(world)]
        for peer in range(1, world):  # what the peers sent
            if ll:
                ll_buffers[0][slot, peer, :rows] = words(partials[peer], epoch)
            else:
                buffers[0][slot, peer, :rows] = partials[peer]
                flags[0][slot, :programs, peer] = epoch
        res = torch.randn(rows, hidden, device=DEVICE).to(dtype) if residual else None
        assert kernel.fits(partials[0])

        out = kernel(partials[0], res, slot)

        summed = sum(p.float() for p in partials).to(dtype)  # what an all-reduce hands back
        assert torch.equal(out, summed + res if residual else summed)
        for peer in range(1, world):  # what we sent the peer
            if ll:
                assert torch.equal(ll_buffers[peer][slot, 0, :rows], words(partials[0], epoch))
                assert not buffers[peer].any() and not flags[peer].any()
            else:
                assert torch.equal(buffers[peer][slot, 0, :rows], partials[0])
                assert flags[peer][slot, :programs, 0].eq(epoch).all()  # our flags there, raised to the epoch
                assert not flags[peer][slot, programs:].any() and not flags[peer][slot, :, 1:].any()
                assert not ll_buffers[peer].any()
        assert kernel.epochs[slot, :programs].eq(epoch).all() and not kernel.epochs[slot, programs:].any()
        for other in range(slots):
            if other != slot:  # other slots untouched
                assert not kernel.epochs[other].any()
                for tensors in (buffers[1:], ll_buffers[1:], flags):
                    assert all(not t[other].any() for t in tensors)
