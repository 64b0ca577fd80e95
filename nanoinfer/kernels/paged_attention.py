"""Triton paged attention: one kernel family for decode, prefill over a cached
prefix and chunked prefill, mixed in one flattened batch.

Each program owns one KV head and a tile of rows; a row is (query token,
query head of that KV head), so all query heads sharing a KV head reuse every
K/V tile it loads (GQA packing). The program walks the sequence's context in
BLOCK_N-token steps, gathering BLOCK_N // block_size cache blocks per step
through the block table, with an online softmax in fp32.

An fp8 cache (`kv_cache_dtype="fp8"`) is upcast as it is loaded; with bf16
queries the dots run in fp16, which holds every fp8 value exactly and converts
from it in one instruction (8% faster than via bf16 on an H200). Its V is
dim-major inside each block (`v_cache.stride(1) == 1`, `dim_major_view` in
layers/attention.py): the P x V dot's k axis is the token axis, and with tokens
adjacent four of them are one 32-bit shared-memory load, where a token-major fp8
V took a byte load each (no transposing ldmatrix exists for 8-bit types); 13-18%
faster decode. Each (block, KV head) of such a V is one run of head_dim x
block_size contiguous bytes; a step that covers whole blocks loads its runs as
they are (a warp instruction reads 512 contiguous bytes) and views them as
[tokens, dims]. Loaded per position instead, a warp's 16-byte pieces touched
twice the L2 sectors they needed (ncu: 33% excess, the kernel L2-bound at 3.0
TB/s); whole runs made fp8 decode 19-24% faster (3.9 TB/s, H200). Such a V is
read in whole blocks, so the slots past the context in a sequence's last block
are multiplied by probability 0 and must hold finite values, which an fp8 cache
guarantees (its writes saturate and store NaN as 0).

Decode-only batches launch one program per (sequence, KV head, split). With
few sequences the context is cut into `num_splits` ranges, so one long
sequence still spreads over the whole GPU; each split stores its partial
result and log-sum-exp, and the last split of a (sequence, KV head) to
arrive (an atomic counter, `arrival_counters`) merges them, all the query
heads of its KV head at once (a GQA-8 model's merged head by head took ~15
us). One launch, no second kernel: at decode batch sizes a merge kernel and
its launch gap cost more than the merge's few kilobytes. A sequence that needs one split stores its output
as final (no partial, no merge). By default each sequence's context is cut into equal
parts; with `balance_programs` every split is at least (the launch's total context x
KV heads / balance_programs) tokens long, so when context lengths differ, long
sequences get more splits than short ones and no program carries far more work than
the rest (the launch's total is summed from `seq_lens` before the PDL wait, so it
needs no host value and a CUDA graph replays it). With `seq_order` (the engine passes the
batch sorted longest context first) the programs take (sequence, KV head) pairs in that
order, all KV heads of a sequence side by side: the GPU starts programs in launch order,
so the last wave holds the shortest contexts instead of a long one running alone
(+8.6% on the reference workload). Every launch parameter comes from host ints
(shapes and `max_query_len` / `max_seq_len`, through `attention_config.choose_config`), never
from device tensors, so decode launches can be captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from nanoinfer.kernels import arrival_counters, pdl_enabled
from nanoinfer.kernels.attention_config import PagedAttentionConfig, max_splits, merge_tile

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Last sequence whose first tile index (query_start // BLOCK_Q + seq) is <= tile.

    Sequence i owns at most q_len_i // BLOCK_Q + 1 tiles, so these starts never
    overlap and the grid needs only num_tokens // BLOCK_Q + num_seqs programs.
    """
    lo = tl.zeros((), dtype=tl.int32)
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        starts_before = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(starts_before, mid, lo)
        hi = tl.where(starts_before, hi, mid - 1)
    return lo


@triton.jit
def _attend(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    k_cache_ptr,
    v_cache_ptr,
    block_table_row,
    head_offset,
    stride_cb,
    stride_cs,
    v_head_offset,
    stride_vb,
    stride_vs,
    stride_vd,
    scale_log2,
    start,
    stop,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    V_DIM_MAJOR: tl.constexpr,
):
    """Online-softmax update over context positions [start, stop), BLOCK_N at a
    time, K/V gathered through the block table. MASKED applies the causal mask
    and the range end; without it every position must be visible to every row.
    start is a multiple of BLOCK_N, and BLOCK_N of BLOCK_SIZE or the reverse."""
    dims = tl.arange(0, HEAD_DIM)
    for n0 in range(start, stop, BLOCK_N):
        pos = tl.multiple_of(n0, BLOCK_N) + tl.arange(0, BLOCK_N)
        if MASKED:
            in_range = pos < stop
            # A dim-major V is loaded in whole blocks (runs of BLOCK_SIZE tokens); K stays exact.
            in_block = (pos // BLOCK_SIZE) * BLOCK_SIZE < stop if V_DIM_MAJOR else in_range
            block = tl.load(block_table_row + pos // BLOCK_SIZE, mask=in_block, other=0).to(tl.int64)
        else:
            block = tl.load(block_table_row + pos // BLOCK_SIZE).to(tl.int64)
        kv_offset = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + head_offset
        if MASKED:
            k = tl.load(k_cache_ptr + kv_offset[None, :] + dims[:, None], mask=in_range[None, :], other=0.0)
        else:
            k = tl.load(k_cache_ptr + kv_offset[None, :] + dims[:, None])
        qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * scale_log2
        if MASKED:
            qk = tl.where((pos[None, :] <= q_pos[:, None]) & in_range[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_DIM_MAJOR and BLOCK_N >= BLOCK_SIZE:
            # Each (block, KV head) of a dim-major V is one run of HEAD_DIM * BLOCK_SIZE contiguous bytes: load
            # the step's runs whole ([blocks, run]), then view them as [tokens, dims].
            NUM_RUNS: tl.constexpr = BLOCK_N // BLOCK_SIZE
            first = tl.multiple_of(n0, BLOCK_N) + tl.arange(0, NUM_RUNS) * BLOCK_SIZE
            run_ok = first < stop
            run_block = tl.load(block_table_row + first // BLOCK_SIZE, mask=run_ok, other=0).to(tl.int64)
            run_start = tl.multiple_of(run_block * stride_vb + v_head_offset, HEAD_DIM * BLOCK_SIZE)
            runs = tl.load(v_cache_ptr + run_start[:, None] + tl.arange(0, HEAD_DIM * BLOCK_SIZE)[None, :],
                           mask=run_ok[:, None], other=0.0)
            v = tl.reshape(tl.permute(tl.reshape(runs, (NUM_RUNS, HEAD_DIM, BLOCK_SIZE)), (0, 2, 1)),
                           (BLOCK_N, HEAD_DIM))
        else:
            v_offset = block * stride_vb + (pos % BLOCK_SIZE) * stride_vs + v_head_offset
            if V_DIM_MAJOR:  # runs of contiguous tokens per dim (the step's part of one block), each aligned
                run: tl.constexpr = BLOCK_SIZE if BLOCK_SIZE < BLOCK_N else BLOCK_N
                v_offset = tl.max_contiguous(tl.multiple_of(v_offset, run), run)
            if MASKED:
                v = tl.load(v_cache_ptr + v_offset[:, None] + dims[None, :] * stride_vd, mask=in_block[:, None],
                            other=0.0)
            else:
                v = tl.load(v_cache_ptr + v_offset[:, None] + dims[None, :] * stride_vd)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


# Triton compiles a variant per integer argument that is 1, divisible by 16, or neither. The batch's
# sequence count and the split count change every step, so they are not specialised: one compile per
# tile configuration, done at start-up, instead of a ~1 s compile in the middle of a run.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "balance_programs", "stride_lt", "stride_lh"])
def _paged_attention_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,  # final output, or fp32 partial outputs [tokens, heads, splits, dim] when SPLIT
    lse_ptr,  # fp32 [tokens, heads, splits] log2-sum-exp of each split (SPLIT only)
    final_ptr,  # final output when SPLIT [tokens, heads, dim]
    counter_ptr,  # int32 arrival counter per (sequence, KV head), all zero between launches (SPLIT only)
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    seq_order_ptr,  # ORDERED: [num_seqs] int32, the sequences longest first
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    num_seqs,
    num_splits,
    balance_programs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_os,
    stride_lt,
    stride_lh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vb,  # V's strides: as K's, or dim-major inside each block (stride_vs == 1)
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    stride_ft,
    stride_fh,
    QUERY_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DECODE: tl.constexpr,
    SPLIT: tl.constexpr,
    MAX_SPLITS: tl.constexpr,  # the merge's split axis (>= num_splits, a power of two)
    MERGE_HEADS: tl.constexpr,  # query heads the merge combines at once (merge_tile)
    MERGE_SPLITS: tl.constexpr,  # splits per step of the merge's loop
    DOT_PRECISION: tl.constexpr,
    F16_DOTS: tl.constexpr,  # fp8 cache, bf16 queries: dots in fp16 (fp8 -> fp16 is one exact convert)
    V_DIM_MAJOR: tl.constexpr,  # stride_vs == 1: V read in whole (block, KV head) runs, or runs of BLOCK_N tokens
    BALANCED: tl.constexpr,  # split lengths from the launch's total context (balance_programs)
    ORDERED: tl.constexpr,  # decode only: programs take (sequence, KV head) pairs in seq_order's order
    NUM_KV_HEADS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Until the PDL wait the program reads only the step's metadata (query_start_loc, seq_lens, written
    # before the first kernel of the step), so that part overlaps the previous kernel's tail.
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:
        seq = tl.program_id(0)
        if ORDERED:
            # The GPU starts programs in launch order: the longest sequences' programs first (all KV heads of a
            # sequence side by side), so the launch's last wave holds the shortest and finishes together.
            launch_index = tl.program_id(0) + tl.program_id(1) * num_seqs
            kv_head = launch_index % NUM_KV_HEADS
            seq = tl.load(seq_order_ptr + launch_index // NUM_KV_HEADS)
        first_tok = 0
    else:
        seq = _find_seq(query_start_loc_ptr, num_seqs, tl.program_id(0), BLOCK_Q)
        first_seq_tile = tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq
        first_tok = (tl.program_id(0) - first_seq_tile) * BLOCK_Q
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if first_tok >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    tok = first_tok + rows // QUERY_GROUP
    head = kv_head * QUERY_GROUP + rows % QUERY_GROUP
    row_valid = (rows < BLOCK_Q * QUERY_GROUP) & (tok < q_len)
    q_pos = seq_len - q_len + tok  # causal: row sees context positions <= q_pos
    token_row = (q_start + tok).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)

    # Context this tile needs, cut into num_splits BLOCK_N-aligned ranges.
    kv_end = tl.minimum(seq_len, seq_len - q_len + first_tok + BLOCK_Q)
    split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    if BALANCED:
        total = tl.zeros((), dtype=tl.int64)  # sequences x context x KV heads can pass 2^31
        for s0 in range(0, num_seqs, 256):
            lens = tl.load(seq_lens_ptr + s0 + tl.arange(0, 256), mask=s0 + tl.arange(0, 256) < num_seqs, other=0)
            total += tl.sum(lens.to(tl.int64), 0)
        fair = tl.minimum(tl.cdiv(total * tl.num_programs(1), balance_programs), kv_end).to(tl.int32)
        split_len = tl.maximum(split_len, tl.cdiv(fair, BLOCK_N) * BLOCK_N)
    kv_start = split * split_len
    kv_stop = tl.minimum(kv_start + split_len, kv_end)
    if SPLIT:
        # Splits are sized for the longest sequence of the launch (a CUDA graph's: max_model_len);
        # a shorter context needs fewer. The rest leave at once and the merge reads only these.
        num_splits = tl.maximum(tl.cdiv(kv_end, tl.maximum(split_len, 1)), 1)
        if split >= num_splits:
            return
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the query and this step's K/V come from the previous kernel
    q = tl.load(
        query_ptr + token_row[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )
    if F16_DOTS:
        q = q.to(tl.float16)  # K/V (and P) follow q's dtype in the dots

    # A finite floor (not -inf) keeps fully masked rows free of inf - inf.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq * stride_bt
    head_offset = kv_head * stride_ch
    masked_start = kv_start
    if not DECODE:
        # Prefill: steps every row sees whole run without masks, so only the
        # causal diagonal pays for them. Decode keeps one masked loop: all its
        # rows sit at the last position, and one pipelined loop streamed up to
        # 6% faster than two on the H200 (bench/kernels.py).
        first_row_end = seq_len - q_len + first_tok + 1
        masked_start += tl.maximum(tl.minimum(first_row_end, kv_stop) - kv_start, 0) // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_table_row, head_offset, stride_cb, stride_cs,
            kv_head * stride_vh, stride_vb, stride_vs, stride_vd, scale_log2, kv_start, masked_start, HEAD_DIM,
            BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, V_DIM_MAJOR,
        )
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_table_row, head_offset, stride_cb, stride_cs,
        kv_head * stride_vh, stride_vb, stride_vs, stride_vd, scale_log2, masked_start, kv_stop, HEAD_DIM,
        BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, V_DIM_MAJOR,
    )

    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may launch while we store and merge
    has_keys = l_i > 0.0  # false only for a zero-length context (splits past the context left above)
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if SPLIT:
        # A context that needed one split is final already: stored as such, no partial and no merge.
        if num_splits == 1:
            final_rows = token_row * stride_ft + head * stride_fh
            tl.store(final_ptr + final_rows[:, None] + dims[None, :], out.to(final_ptr.dtype.element_ty),
                     mask=row_valid[:, None])
        else:
            out_rows = token_row * stride_ot + head * stride_oh + split * stride_os
            tl.store(out_ptr + out_rows[:, None] + dims[None, :], out, mask=row_valid[:, None])
            lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + token_row * stride_lt + head * stride_lh + split, lse, mask=row_valid)
            # Every thread's stores are ordered before the (one-thread, acq_rel, GPU-scope) arrival.
            tl.debug_barrier()
            counter = counter_ptr + seq * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1) == num_splits - 1:
                _merge_splits(out_ptr, lse_ptr, final_ptr, q_start.to(tl.int64), kv_head * QUERY_GROUP, num_splits,
                              stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_ft, stride_fh,
                              QUERY_GROUP, MERGE_HEADS, MERGE_SPLITS, HEAD_DIM, MAX_SPLITS)
                tl.store(counter, 0)
    else:
        out_rows = token_row * stride_ot + head * stride_oh
        tl.store(out_ptr + out_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _merge_splits(partial_ptr, lse_ptr, final_ptr, token_row, first_head, num_splits, stride_ot, stride_oh,
                  stride_os, stride_lt, stride_lh, stride_ft, stride_fh, QUERY_GROUP: tl.constexpr,
                  HEAD_TILE: tl.constexpr, SPLIT_CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
                  MAX_SPLITS: tl.constexpr):
    """The last split of a (token, KV head) to finish: each of its query heads' output is every split's normalised
    output weighted by exp2(lse - max lse) (a zero-length context: lse -inf, output 0). HEAD_TILE query heads at
    once (the whole group up to 16), SPLIT_CHUNK splits per step (one step unless the context needed many), the
    step's loads unrolled so they are in flight together, summed elementwise (a reduction over a [heads, splits,
    dim] tile crossed warps in Triton 3.9: 34 barriers per step at GQA 8; this loop has 8 in 3.6 and 3.9). Merged
    head by head, the chain of L2 round trips and reductions had cost ~2 us per query head on an H200, ~15 us for
    a GQA-8 model's 8 (bench/NOTES.md, 2026-11-29 20:22). .cg: other programs wrote them."""
    dims = tl.arange(0, HEAD_DIM)
    splits = tl.arange(0, MAX_SPLITS)
    for first_in_group in tl.static_range(0, QUERY_GROUP, HEAD_TILE):
        group_head = first_in_group + tl.arange(0, HEAD_TILE)
        head_valid = group_head < QUERY_GROUP
        head = first_head + group_head
        lse_row = lse_ptr + token_row * stride_lt + head[:, None] * stride_lh  # [heads, 1] throughout: one layout
        lse = tl.load(lse_row + splits[None, :], mask=head_valid[:, None] & (splits < num_splits)[None, :],
                      other=float("-inf"), cache_modifier=".cg")
        lse_max = tl.max(lse, 1, keep_dims=True)
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
        total = tl.sum(tl.exp2(lse - lse_max), 1, keep_dims=True)
        partial_row = partial_ptr + token_row * stride_ot + head[:, None] * stride_oh + dims[None, :]
        acc = tl.zeros([HEAD_TILE, HEAD_DIM], dtype=tl.float32)
        for first in range(0, num_splits, SPLIT_CHUNK):
            for offset in tl.static_range(SPLIT_CHUNK):
                split = first + offset
                valid = head_valid[:, None] & (group_head[:, None] * 0 + split < num_splits)
                weight = tl.exp2(tl.load(lse_row + split, mask=valid, other=float("-inf"), cache_modifier=".cg")
                                 - lse_max)
                partial = tl.load(partial_row + split * stride_os, mask=valid, other=0.0, cache_modifier=".cg")
                acc += partial * weight
        out = acc / tl.where(total > 0.0, total, 1.0)
        tl.store(final_ptr + token_row * stride_ft + head[:, None] * stride_fh + dims[None, :],
                 out.to(final_ptr.dtype.element_ty), mask=head_valid[:, None])


def _check_inputs(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables) -> None:
    if query.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"query must be [num_tokens, num_heads, head_dim] and the cache [num_blocks, block_size, num_kv_heads, head_dim]; "
            f"got {tuple(query.shape)} and {tuple(k_cache.shape)}"
        )
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must have the same shape and dtype")
    block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
    if v_cache.stride() != k_cache.stride() and v_cache.stride()[1:] != (1, block_size * head_dim, block_size):
        raise ValueError("v_cache must be laid out as k_cache, or dim-major inside each block "
                         "(nanoinfer.layers.attention.dim_major_view)")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {k_cache.shape[3]} != query head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim} unsupported: the Triton backend needs a power of two >= 16")
    if query.dtype not in _SUPPORTED_DTYPES or k_cache.dtype not in _SUPPORTED_DTYPES + (torch.float8_e4m3fn,):
        raise TypeError(f"unsupported dtypes query={query.dtype} cache={k_cache.dtype}; use float16, bfloat16 or "
                        f"float32 (and float8_e4m3fn for the cache)")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_tables", block_tables)):
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1 or block_tables.shape[0] < seq_lens.shape[0]:
        raise ValueError("query_start_loc must have num_seqs + 1 entries and block_tables at least num_seqs rows")
    if query.stride(2) != 1 or k_cache.stride(3) != 1 or block_tables.stride(1) != 1:
        raise ValueError("query, cache and block_tables need a contiguous last dimension")


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
    *,
    max_query_len: int,
    config: PagedAttentionConfig,
    seq_order: torch.Tensor | None = None,  # [num_seqs] int32, a permutation
) -> torch.Tensor:
    """Causal attention of each sequence's queries over its paged context. With `seq_order` (a decode config
    only: the sequences longest first) the launch runs the longest contexts first, so unequal contexts leave a
    short tail."""
    _check_inputs(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    if config.decode and max_query_len > 1:
        raise ValueError(f"a decode config needs max_query_len <= 1, got {max_query_len}")
    if config.num_splits > 1 and not config.decode:
        raise ValueError("split-KV is only for decode configs")
    if seq_order is not None and (not config.decode or seq_order.dtype != torch.int32
                                  or seq_order.shape != seq_lens.shape):
        raise ValueError("seq_order is for decode configs: an int32 permutation of the sequences, one per seq_lens entry")
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k_cache.shape[2]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    split = config.num_splits > 1
    if split:
        partial = torch.empty((num_tokens, num_heads, config.num_splits, head_dim), dtype=torch.float32, device=query.device)
        lse = torch.empty((num_tokens, num_heads, config.num_splits), dtype=torch.float32, device=query.device)
        target, stride_os, lse_strides = partial, partial.stride(2), (lse.stride(0), lse.stride(1))
        counters = arrival_counters(query.device, num_seqs * num_kv_heads)
    else:
        lse, target, stride_os, lse_strides, counters = out, out, 0, (0, 0), out
    pdl = pdl_enabled(query.device)
    merge_heads, merge_splits = merge_tile(num_heads // num_kv_heads, config.max_registers)
    if config.decode:
        grid = (num_seqs, num_kv_heads, config.num_splits)
    else:
        grid = (num_tokens // config.block_q + num_seqs, num_kv_heads, 1)
    _paged_attention_kernel[grid](
        query,
        k_cache,
        v_cache,
        target,
        lse,
        out,
        counters,
        query_start_loc,
        seq_lens,
        block_tables,
        seq_order if seq_order is not None else seq_lens,
        scale * math.log2(math.e),
        num_seqs,
        config.num_splits,
        max(config.balance_programs, 1),
        query.stride(0),
        query.stride(1),
        target.stride(0),
        target.stride(1),
        stride_os,
        *lse_strides,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *v_cache.stride(),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        QUERY_GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_Q=config.block_q,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        DECODE=config.decode,
        SPLIT=split,
        MAX_SPLITS=max_splits(config),
        MERGE_HEADS=merge_heads,
        MERGE_SPLITS=merge_splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        F16_DOTS=k_cache.dtype == torch.float8_e4m3fn and query.dtype == torch.bfloat16,
        V_DIM_MAJOR=v_cache.stride(1) == 1,
        BALANCED=split and config.balance_programs > 0,
        ORDERED=seq_order is not None,
        NUM_KV_HEADS=num_kv_heads,
        USE_PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        launch_pdl=pdl,
        **({"maxnreg": config.max_registers} if config.max_registers else {}),
    )
    return out
