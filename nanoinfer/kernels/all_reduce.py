"""One Triton kernel for what follows every row-parallel layer of a tensor-parallel
decoder at decode sizes: sum the ranks' partial outputs, add the residual stream,
RMS-normalise. Done as separate ops that was a copy into a symmetric-memory buffer,
torch's one-shot all-reduce and the compiled add + norm: three kernels and their
launch gaps, twice per layer (bench/NOTES.md, TP section).

Each rank owns a buffer in torch symmetric memory that every peer can read over
NVLink, and an int32 flag per (row, peer). One program handles one token row:

1. store this rank's partial row into its own buffer;
2. for each peer, raise the flag "my row is there" in the peer's flag array
   (spinning while the peer has not yet taken the previous call's flag: compare
   and swap 0 -> 1, release, system scope);
3. for each peer, wait for its flag in our array and take it (1 -> 0, acquire);
4. read every rank's row (own included) and sum in rank order, in float32, so
   every rank computes bit-identical sums; round to the model dtype as an
   all-reduce would; add the residual (rounded, as `x + residual` is); normalise
   as `rms_norm_math` does.

A rank may start the next call while a peer still reads its buffer from this one,
so consecutive calls must use different buffers: the caller alternates two slots
(the decoder's post-attention norms use one, its input and final norms the other).
A third call can only reuse a slot after every peer has arrived at the second, that
is, finished reading the first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    partial_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    buffer_ptrs,  # int64 [world]: every rank's buffer for this call's slot
    flag_ptrs,  # int64 [world]: every rank's flags, int32 [max_rows, world]
    rank,
    hidden,
    eps,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    offsets = row.to(tl.int64) * hidden + cols
    dtype = partial_ptr.dtype.element_ty
    own_buffer = tl.load(buffer_ptrs + rank).to(tl.pointer_type(dtype))
    tl.store(own_buffer + offsets, tl.load(partial_ptr + offsets, mask=mask), mask=mask)
    tl.debug_barrier()  # every thread's store is ordered before the release below
    for peer in tl.static_range(WORLD):
        if peer != rank:
            flag = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32)) + row * WORLD + rank
            while tl.atomic_cas(flag, 0, 1, sem="release", scope="sys") != 0:
                pass
    for peer in tl.static_range(WORLD):
        if peer != rank:
            flag = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32)) + row * WORLD + peer
            while tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()  # ... and every thread's peer reads after the acquire
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        buffer = tl.load(buffer_ptrs + r).to(tl.pointer_type(dtype))
        total += tl.load(buffer + offsets, mask=mask, other=0.0, volatile=True).to(tl.float32)
    summed = total.to(dtype).to(tl.float32)
    residual = summed + tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    residual = residual.to(dtype)
    tl.store(residual_out_ptr + offsets, residual, mask=mask)
    r32 = residual.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(r32 * r32, axis=0) / hidden + eps)
    normed = (r32 * rstd).to(dtype) * tl.load(weight_ptr + cols, mask=mask)
    tl.store(out_ptr + offsets, normed, mask=mask)


class FusedAllReduce:
    """The fused kernel with its symmetric buffers and flags; `parallel_state.enable_symmetric_all_reduce`
    builds one on every rank (the buffers' rendezvous is collective). `max_rows` x `hidden` is the
    largest input it takes."""

    SLOTS = 2

    def __init__(self, buffers: list[torch.Tensor], flags: list[torch.Tensor], rank: int,
                 max_rows: int, hidden: int) -> None:
        """`buffers[r]`: rank r's buffer [SLOTS, max_rows, hidden] as this rank sees it, `flags[r]`:
        its flags [max_rows, world], zeroed; this rank's own entries must be the tensors that own
        the memory (kept here: peers' views of an allocation do not keep it alive)."""
        world = len(buffers)
        self.rank, self.world, self.max_rows, self.hidden = rank, world, max_rows, hidden
        self.dtype = buffers[0].dtype
        device = buffers[rank].device
        self.buffer_ptrs = torch.tensor([[b[slot].data_ptr() for b in buffers] for slot in range(self.SLOTS)],
                                        dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64, device=device)
        self.buffers, self.flags = buffers, flags

    def fits(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.shape[0] <= self.max_rows and x.shape[1] == self.hidden and x.dtype == self.dtype

    def __call__(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(sum over ranks of `partial` + residual), that sum + residual); see the module doc."""
        partial, residual = partial.contiguous(), residual.contiguous()
        out, residual_out = torch.empty_like(partial), torch.empty_like(partial)
        block = triton.next_power_of_2(self.hidden)
        _all_reduce_add_rms_norm_kernel[(partial.shape[0],)](
            partial, residual, weight, out, residual_out, self.buffer_ptrs[slot], self.flag_ptrs,
            self.rank, self.hidden, eps, WORLD=self.world, BLOCK=block, num_warps=8 if block >= 4096 else 4,
        )
        return out, residual_out
