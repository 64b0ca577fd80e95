"""One Triton kernel for what follows every row-parallel layer of a tensor-parallel
decoder at decode sizes: sum the ranks' partial outputs, add the residual stream,
RMS-normalise. As separate ops that was a copy into a symmetric-memory buffer,
torch's one-shot all-reduce and the compiled add + norm: three kernels and their
launch gaps, twice per layer (bench/NOTES.md, TP section).

Each rank owns, in torch symmetric memory (mapped into every peer over NVLink), a
buffer with one region per sender and an int32 flag per (program, sender). Program
p of every rank handles the same rows (rows are cut into the same chunks on every
rank) and, for each call:

1. *pushes* its partial rows into its own region of every peer's buffer (stores over
   NVLink do not wait for an answer);
2. raises, in every peer's flags, its flag to this call's epoch (its count of calls
   in this slot, kept per program on each rank: all ranks count the same calls), with
   release semantics at system scope so the rows land first;
3. waits until every peer's flag in its own (local) flags shows the epoch;
4. sums every rank's rows in rank order, in float32, reading the peers' from local
   memory, so every rank computes bit-identical sums; rounds to the model dtype as an
   all-reduce would; adds the residual (rounded, as `x + residual` is); normalises as
   `rms_norm_math` does.

Only one NVLink crossing is on the critical path (the pushed rows and the flag behind
them); an earlier version pulled the peers' rows after a compare-and-swap handshake,
two round trips (6.5 us a call on two H200s). A peer may start the next call while we
still read this one's rows, so consecutive calls must use different slots: the decoder's
post-attention norms use slot 0, its input and final norms 1, the first layer's input
norm (which sums the vocab-parallel embedding and has no residual yet) 2. A peer can
write a slot again only after it saw our flag of the call in between, which we raise
only once this call is done.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoinfer.kernels import pdl_enabled


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    partial_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    buffer_ptrs,  # int64 [world]: every rank's buffer for this slot, [world (sender), max_rows, hidden]
    flag_ptrs,  # int64 [world]: every rank's flags for this slot, int32 [MAX_PROGRAMS, world (sender)]
    epoch_ptr,  # int32 [MAX_PROGRAMS]: this rank's calls per program in this slot
    rank,
    rows,
    rows_per_program,
    hidden,
    region_size,  # max_rows * hidden: one sender's region
    eps,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    first = program * rows_per_program
    last = tl.minimum(first + rows_per_program, rows)
    dtype = partial_ptr.dtype.element_ty
    region = rank * region_size  # our region in every rank's buffer
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    epoch = tl.load(epoch_ptr + program) + 1
    tl.store(epoch_ptr + program, epoch)
    for row in range(first, last):
        offsets = row * hidden + cols
        x = tl.load(partial_ptr + offsets, mask=mask)
        for peer in tl.static_range(WORLD):
            if peer != rank:
                peer_buffer = tl.load(buffer_ptrs + peer).to(tl.pointer_type(dtype))
                tl.store(peer_buffer + region + offsets, x, mask=mask)
    tl.debug_barrier()  # every thread's stores are ordered before the release below
    for peer in tl.static_range(WORLD):
        if peer != rank:
            flag = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32)) + program * WORLD + rank
            tl.atomic_xchg(flag, epoch, sem="release", scope="sys")
    for peer in tl.static_range(WORLD):
        if peer != rank:
            flag = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int32)) + program * WORLD + peer
            while tl.atomic_add(flag, 0, sem="acquire", scope="sys") != epoch:
                pass
    tl.debug_barrier()  # ... and every thread's reads of the peers' rows after the acquire
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    own_buffer = tl.load(buffer_ptrs + rank).to(tl.pointer_type(dtype))
    for row in range(first, last):
        offsets = row * hidden + cols
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            if r == rank:
                total += tl.load(partial_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            else:
                total += tl.load(own_buffer + r * region_size + offsets, mask=mask, other=0.0, volatile=True).to(tl.float32)
        residual = total.to(dtype)
        if HAS_RESIDUAL:
            residual = (residual.to(tl.float32) + tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + offsets, residual, mask=mask)
        r32 = residual.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(r32 * r32, axis=0) / hidden + eps)
        normed = (r32 * rstd).to(dtype) * tl.load(weight_ptr + cols, mask=mask)
        tl.store(out_ptr + offsets, normed, mask=mask)


class FusedAllReduce:
    """The fused kernel with its symmetric buffers and flags; `parallel_state.enable_symmetric_all_reduce`
    builds one on every rank (the buffers' rendezvous is collective). `max_rows` x `hidden` is the
    largest input it takes."""

    SLOTS = 3
    MAX_PROGRAMS = 128  # rows are cut into at most this many chunks, one program each

    def __init__(self, buffers: list[torch.Tensor], flags: list[torch.Tensor], rank: int,
                 max_rows: int, hidden: int) -> None:
        """`buffers[r]`: rank r's buffer [SLOTS, world, max_rows, hidden] as this rank sees it,
        `flags[r]`: its flags [SLOTS, MAX_PROGRAMS, world], zeroed on every rank before any call;
        this rank's own entries must be the tensors that own the memory (kept here: peers' views
        of an allocation do not keep it alive)."""
        world = len(buffers)
        if world * max_rows * hidden >= 2**31:
            raise ValueError(f"{world} x {max_rows} x {hidden} elements per slot: the kernel uses int32 offsets")
        self.rank, self.world, self.max_rows, self.hidden = rank, world, max_rows, hidden
        self.dtype = buffers[0].dtype
        device = buffers[rank].device
        self.buffer_ptrs = torch.tensor([[b[slot].data_ptr() for b in buffers] for slot in range(self.SLOTS)],
                                        dtype=torch.int64, device=device)
        self.flag_ptrs = torch.tensor([[f[slot].data_ptr() for f in flags] for slot in range(self.SLOTS)],
                                      dtype=torch.int64, device=device)
        self.epochs = torch.zeros(self.SLOTS, self.MAX_PROGRAMS, dtype=torch.int32, device=device)
        self.buffers, self.flags = buffers, flags
        self.use_pdl = pdl_enabled(device)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.shape[0] <= self.max_rows and x.shape[1] == self.hidden and x.dtype == self.dtype

    def __call__(self, partial: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(s), s) with s = the sum over ranks of `partial` (+ `residual` when given);
        see the module doc."""
        partial = partial.contiguous()
        rows = partial.shape[0]
        out, residual_out = torch.empty_like(partial), torch.empty_like(partial)
        if rows == 0:
            return out, residual_out
        rows_per_program = triton.cdiv(rows, self.MAX_PROGRAMS)
        block = triton.next_power_of_2(self.hidden)
        _all_reduce_add_rms_norm_kernel[(triton.cdiv(rows, rows_per_program),)](
            partial, residual.contiguous() if residual is not None else partial, weight, out, residual_out,
            self.buffer_ptrs[slot], self.flag_ptrs[slot], self.epochs[slot],
            self.rank, rows, rows_per_program, self.hidden, self.max_rows * self.hidden, eps,
            WORLD=self.world, BLOCK=block, HAS_RESIDUAL=residual is not None, USE_PDL=self.use_pdl,
            num_warps=8 if block >= 4096 else 4, launch_pdl=self.use_pdl,
        )
        return out, residual_out
