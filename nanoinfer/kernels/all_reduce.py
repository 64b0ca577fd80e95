"""One Triton kernel for what follows every row-parallel layer of a tensor-parallel
decoder at decode sizes: sum the ranks' partial outputs and add the residual stream.
As separate ops that was a copy into a symmetric-memory buffer, torch's one-shot
all-reduce and the add: three kernels and their launch gaps, twice per layer
(bench/NOTES.md, TP section). It no longer RMS-normalises: the decoder's norms moved
into the kernels after the next matmul, whose weights hold the norm's weight
(`DeferredNorm`, layers/layernorm.py).

Each rank owns buffers in torch symmetric memory (mapped into every peer over
NVLink) with one region per sender. Every rank cuts the rows into the same chunks,
one per program, and counts its calls per (slot, program): the epoch, the same on
every rank. Program p of each rank *pushes* its partial rows into its region of every
peer's buffer (stores over NVLink do not wait for an answer), then waits for the
peers' rows in its own, local, memory:

* up to LL_ROWS rows (decode at small batches, where latency is all): each element
  travels in an int64 word with the epoch in its high half, so a word is its own
  arrival flag and the sender needs no fence between data and flag (NCCL's "LL"
  protocol). The receiver re-reads until every word shows the epoch.
* more rows: the rows as they are (a quarter of the bytes for 16-bit types), then per
  program one int32 flag per peer, set to the epoch with release semantics at system scope
  (which waits for the rows to land), and the receiver waits on its flags.

Then it sums every rank's rows in rank order, in float32, so every rank computes
bit-identical sums; rounds to the model dtype as an all-reduce would; adds the
residual (rounded, as `x + residual` is).

A peer may start the next call while we still read this one's rows, so consecutive
calls must use different slots: the row-parallel layers o_proj use slot 0 and
down_proj 1, the vocab-parallel embedding (which has no residual) 2. A peer can write
a slot again only after it has our rows of the call in between, which we send only
once this call is done. Stale words never pass for new ones: a row's words are written
by the same program each time (one row per program below LL_ROWS), whose epoch only
grows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoinfer.kernels import pdl_enabled


@triton.jit
def _add_store(total, partial_ptr, residual_ptr, out_ptr, offsets, mask, HAS_RESIDUAL: tl.constexpr):
    """Round the float32 sum to the model dtype (as an all-reduce hands it back), add the residual
    (rounded, as `x + residual` is), store."""
    dtype = partial_ptr.dtype.element_ty
    out = total.to(dtype)
    if HAS_RESIDUAL:
        out = (out.to(tl.float32) + tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    tl.store(out_ptr + offsets, out, mask=mask)


@triton.jit
def _all_reduce_add_kernel(
    partial_ptr,
    residual_ptr,
    out_ptr,
    buffer_ptrs,  # int64 [world]: every rank's buffer for this slot, [world (sender), max_rows, hidden]
    flag_ptrs,  # int64 [world]: every rank's flags for this slot, int32 [MAX_PROGRAMS, world (sender)]
    epoch_ptr,  # int32 [MAX_PROGRAMS]: this rank's calls per program in this slot
    rank,
    rows,
    rows_per_program,
    hidden,
    region_size,  # rows x hidden of one sender's region (max_rows, or LL_ROWS with LL)
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    LL: tl.constexpr,  # one row per program, rows sent as (epoch << 32 | element bits) words
    BITS: tl.constexpr,  # the integer type of the model dtype's width (LL)
    USE_PDL: tl.constexpr,
):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    region = rank * region_size  # our region in every rank's buffer
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    epoch = tl.load(epoch_ptr + program) + 1
    # Every thread has read the count before one stores the next (a warp that read it late
    # would use the next epoch, and its flags and waits would never match the peer's).
    tl.debug_barrier()
    tl.store(epoch_ptr + program, epoch)
    if LL:
        # Each word carries its own arrival flag: no fence between the rows and a flag, no flag.
        offsets = program * hidden + cols
        x = tl.load(partial_ptr + offsets, mask=mask)
        payload = x.to(BITS, bitcast=True).to(tl.int64) & ((1 << BITS.primitive_bitwidth) - 1)
        tag = epoch.to(tl.int64) << 32
        for peer in tl.static_range(WORLD):
            if peer != rank:
                peer_buffer = tl.load(buffer_ptrs + peer).to(tl.pointer_type(tl.int64))
                tl.store(peer_buffer + region + offsets, payload | tag, mask=mask)
        own_buffer = tl.load(buffer_ptrs + rank).to(tl.pointer_type(tl.int64))
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            if r == rank:
                total += x.to(tl.float32)
            else:
                words = own_buffer + r * region_size + offsets
                word = tl.load(words, mask=mask, other=tag, volatile=True)
                while tl.sum(((word >> 32) != epoch).to(tl.int32), axis=0) > 0:
                    word = tl.load(words, mask=mask, other=tag, volatile=True)
                total += word.to(BITS).to(partial_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        _add_store(total, partial_ptr, residual_ptr, out_ptr, offsets, mask, HAS_RESIDUAL)
    else:
        dtype = partial_ptr.dtype.element_ty
        first = program * rows_per_program
        last = tl.minimum(first + rows_per_program, rows)
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
                    total += tl.load(own_buffer + r * region_size + offsets, mask=mask, other=0.0,
                                     volatile=True).to(tl.float32)
            _add_store(total, partial_ptr, residual_ptr, out_ptr, offsets, mask, HAS_RESIDUAL)


class FusedAllReduce:
    """The fused kernel with its symmetric buffers and flags; `parallel_state.enable_symmetric_all_reduce`
    builds one on every rank (the buffers' rendezvous is collective). `max_rows` x `hidden` is the
    largest input it takes."""

    SLOTS = 3
    MAX_PROGRAMS = 128  # rows are cut into at most this many chunks, one program each
    LL_ROWS = 16  # up to this many rows travel as flag-carrying words (see the module doc)
    _BITS = {2: tl.int16, 4: tl.int32}

    def __init__(self, buffers: list[torch.Tensor], ll_buffers: list[torch.Tensor], flags: list[torch.Tensor],
                 rank: int, max_rows: int, hidden: int) -> None:
        """As this rank sees them, rank r's `buffers[r]` [SLOTS, world, max_rows, hidden] (model dtype),
        `ll_buffers[r]` [SLOTS, world, LL_ROWS, hidden] (int64) and `flags[r]` [SLOTS, MAX_PROGRAMS,
        world] (int32); buffers and flags zeroed on every rank before any call. This rank's own
        entries must be the tensors that own the memory (kept here: peers' views of an allocation
        do not keep it alive)."""
        world = len(buffers)
        if world * max(max_rows, self.LL_ROWS) * hidden >= 2**31:
            raise ValueError(f"{world} x {max_rows} x {hidden} elements per slot: the kernel uses int32 offsets")
        self.rank, self.world, self.max_rows, self.hidden = rank, world, max_rows, hidden
        self.dtype = buffers[0].dtype
        if self.dtype.itemsize not in self._BITS:
            raise ValueError(f"the fused all-reduce takes 16- or 32-bit floats, not {self.dtype}")
        device = buffers[rank].device

        def pointers(tensors: list[torch.Tensor]) -> torch.Tensor:
            return torch.tensor([[t[slot].data_ptr() for t in tensors] for slot in range(self.SLOTS)],
                                dtype=torch.int64, device=device)

        self.buffer_ptrs, self.ll_buffer_ptrs, self.flag_ptrs = pointers(buffers), pointers(ll_buffers), pointers(flags)
        self.epochs = torch.zeros(self.SLOTS, self.MAX_PROGRAMS, dtype=torch.int32, device=device)
        self.owned = (buffers[rank], ll_buffers[rank], flags[rank])
        self.use_pdl = pdl_enabled(device)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.shape[0] <= self.max_rows and x.shape[1] == self.hidden and x.dtype == self.dtype

    def __call__(self, partial: torch.Tensor, residual: torch.Tensor | None, slot: int) -> torch.Tensor:
        """The sum over ranks of `partial` (+ `residual` when given), in a new tensor; see the module doc."""
        partial = partial.contiguous()
        rows = partial.shape[0]
        out = torch.empty_like(partial)
        if rows == 0:
            return out
        ll = rows <= self.LL_ROWS
        rows_per_program = 1 if ll else triton.cdiv(rows, self.MAX_PROGRAMS)
        block = triton.next_power_of_2(self.hidden)
        _all_reduce_add_kernel[(triton.cdiv(rows, rows_per_program),)](
            partial, residual.contiguous() if residual is not None else partial, out,
            (self.ll_buffer_ptrs if ll else self.buffer_ptrs)[slot], self.flag_ptrs[slot], self.epochs[slot],
            self.rank, rows, rows_per_program, self.hidden, (self.LL_ROWS if ll else self.max_rows) * self.hidden,
            WORLD=self.world, BLOCK=block, HAS_RESIDUAL=residual is not None, LL=ll, BITS=self._BITS[self.dtype.itemsize],
            USE_PDL=self.use_pdl, num_warps=8 if block >= 4096 else 4, launch_pdl=self.use_pdl,
        )
        return out
