"""Fused mixture-of-experts MLP (layers/moe.py's `fused_moe_math`) as two launches of one Triton grouped GEMM:
every token's top-k experts in one pass, with no host synchronisation, so CUDA graphs capture it.

The PyTorch math loops over the experts in use, each with its own token list: the lists' lengths are data, so
it waits on the host every layer and cannot be captured. Here:

* `moe_align` sorts the T * k (token, slot) entries by expert and pads each expert's run to a multiple of
  BLOCK_M, so every BLOCK_M-row block of the sorted layout belongs to one expert. Its outputs have sizes that
  depend on T, k, E and BLOCK_M alone (an upper bound on the padded length); how many blocks are used is a
  device tensor that the GEMM programs read. Two small Triton kernels (per-chunk expert counts; then each
  entry's position from the counts before it, and the padding; up to 8 tokens at k = 8, the second kernel
  alone, counting the few entries itself): 5-7 us at decode in a CUDA graph on an H200 with both kernels,
  where the same done with torch ops (sort, searchsorted, cumsum, scatter: about twenty launches) took 40-60,
  more than the expert GEMMs of a one-token batch.
* `_moe_gemm_kernel` runs one program per (row block, column tile). It gathers its block's rows of A by entry
  (the first GEMM: token = entry // k of x; the second: row = entry of the intermediate), walks K against its
  expert's weight [N, K], and ends in one of two epilogues:
  - gated (x -> intermediate [T * k, I]): the program accumulates the gate columns n and the up columns I + n
    of w13 against the same A tile, and stores silu(gate) * up, computed in float32 from the accumulators and
    rounded once to the intermediate's dtype, x's (the PyTorch math rounds gate/up, silu and the product each:
    within a few ulp) or float16 (below);
  - weighted (intermediate -> buffer [T * k, H] float32): the float32 accumulator times the entry's routing
    weight.
  Programs whose row block is past the used ones return at once; padding rows are masked out.
* A last small kernel sums each token's k rows of the buffer in float32, in slot order (with the residual stream
  row, when given), and rounds once: no atomics, so the result is deterministic.
* Before all of it, `topk_softmax` routes each token in one program (softmax, top-k, renormalisation), where the
  PyTorch ops took six launches a layer.

fp8 experts (`quantization="fp8"`) are converted to the activations' dtype as the GEMM loads them, each product
scaled by its weight row's scale in the epilogue (weight-only, as the skinny kernel's). In a bfloat16 model the
GEMMs multiply in float16, so that each pair of e4m3 weights takes one conversion instruction: converting them to
bfloat16 takes a second per value (F2F on Hopper, a quarter-rate unit), which bound the GEMM by conversions (on an
H200 before this path, fp8 read at 2.8 TB/s at most where bf16 weights read 4.2; the decode tile's K loop is 289
SASS instructions that way against 192 this way, Triton 3.6 for sm_90 counted offline; on the H200 one layer's
experts went 31.1 -> 25.8 us at one token, 209.5 -> 167.8 at 64, bench/RESULTS.md). Its ranges:
  - x is converted once per call (`_to_float16_kernel`): exact for magnitudes from 2^-17 to 65504 (bfloat16's 8
    significant bits fit float16's grid there); smaller ones round to float16's subnormal steps (an absolute
    error up to 2^-25), larger finite ones saturate at 65504 (an RMS-normalised x stays far below), inf and NaN
    stay what they are;
  - the intermediate is stored as float16 times F16_HIDDEN_SCALE (2^-4, exact; the down GEMM's epilogue takes it
    out): values up to 65504 x 16 ~ 1.05e6 (MLP outliers of thousands fit), float16's 11-bit precision from
    2^-10 up (bfloat16's is 8 bits), an absolute error up to 2^-21 below, larger finite values saturate. A
    larger shift would buy range by making more of the typical 1e-3..1 values subnormal.
In float16 and float32 models the intermediate is in x's dtype, unscaled and unsaturated, as the math's.

Launch parameters are pure functions of host ints (`choose_block_m`, `choose_config`; no autotuning, which
would re-tune inside CUDA-graph capture): 16-row blocks when experts see few rows each (decode), 64 when they
see many (prefill), tiles swept on an H200 at Qwen3-30B-A3B's shapes (H=2048, I=768, E=128, k=8, bf16).
Measured there (2026-11, Triton 3.6), the whole call: 33 us at T=1 (the 8 experts' weights alone take ~17.5 at
4.3 TB/s), 292 us at T=64 (4.1 TB/s over the 127 experts in use), 333 at T=256, 1.76 ms at T=8192 (350
TFLOP/s; writing and re-reading the float32 [T * k, H] buffer is ~0.25 ms of it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanoinfer.kernels import INTERPRETER

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_SUM_BLOCK = 1024
F16_HIDDEN_SCALE = 2.0**-4  # the float16 intermediate of fp8 experts in a bf16 model is stored times this
_GROUP_M = 8  # row blocks that walk the column tiles together (their A rows and weight tiles stay in L2)


# ----- routing: sort entries by expert, padded to whole row blocks -----


def padded_size(num_entries: int, num_experts: int, block_m: int) -> int:
    """A static bound on the padded layout's length: each expert in use (at most min(E, T * k) of them) pads its
    run by fewer than block_m entries."""
    bound = num_entries + min(num_experts, num_entries) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_entries, chunk_len, STEP: tl.constexpr, E_PAD: tl.constexpr):
    """counts[chunk, e]: how many of the chunk's chunk_len entries (STEP at a time) go to expert e."""
    chunk = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for start in range(chunk * chunk_len, (chunk + 1) * chunk_len, STEP):
        idx = start + tl.arange(0, STEP)
        ids = tl.load(ids_ptr + idx, mask=idx < num_entries, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + chunk * E_PAD + experts, counts)


@triton.jit
def _align_kernel(ids_ptr, counts_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, num_entries, num_experts,
                  num_chunks, chunk_len, size, slice_len, BLOCK_M: tl.constexpr, STEP: tl.constexpr,
                  E_PAD: tl.constexpr, ROWS: tl.constexpr, SELF_COUNT: tl.constexpr):
    """Programs 0 .. num_chunks - 1 place their chunk's entries; the others each fill a slice_len-long slice of
    the padded layout's padding and the experts of the blocks starting in it. Every position of sorted_ids and
    block_expert is written by exactly one program (no atomics, no order between programs). SELF_COUNT (one
    chunk of a few entries): every program counts them itself, and `_count_kernel` is not launched."""
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    # Each expert's total, and how many of its entries the chunks before this one hold (at most ~128 chunks:
    # every program reads all their counts).
    totals = tl.zeros((E_PAD,), dtype=tl.int32)
    before = tl.zeros((E_PAD,), dtype=tl.int32)
    if SELF_COUNT:
        for start in range(0, num_entries, STEP):
            idx = start + tl.arange(0, STEP)
            ids = tl.load(ids_ptr + idx, mask=idx < num_entries, other=-1).to(tl.int32)
            totals += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    else:
        for r in range(0, num_chunks, ROWS):
            rows = r + tl.arange(0, ROWS)
            counts = tl.load(counts_ptr + rows[:, None] * E_PAD + experts[None, :],
                             mask=rows[:, None] < num_chunks, other=0)
            totals += tl.sum(counts, axis=0)
            before += tl.sum(tl.where(rows[:, None] < pid, counts, 0), axis=0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    if pid < num_chunks:
        # An entry goes to its expert's padded start + the entries of that expert before it (earlier chunks,
        # earlier steps, then earlier in its step): entries keep their order within an expert.
        next_pos = starts + before
        for start in range(pid * chunk_len, (pid + 1) * chunk_len, STEP):
            idx = start + tl.arange(0, STEP)
            mask = idx < num_entries
            ids = tl.load(ids_ptr + idx, mask=mask, other=-1).to(tl.int32)
            onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
            rank = tl.cumsum(onehot, axis=0) - onehot
            pos = tl.sum(onehot * (rank + next_pos[None, :]), axis=1)
            tl.store(sorted_ids_ptr + pos, idx, mask=mask)
            next_pos += tl.sum(onehot, axis=0)
    else:
        ends_real = starts + totals
        first = (pid - num_chunks) * slice_len
        for start in range(first, first + slice_len, STEP):
            pos = start + tl.arange(0, STEP)
            mask = pos < size
            # the expert of pos: those whose padded run ends at or before it (E or more past the used length)
            expert = tl.sum((ends[None, :] <= pos[:, None]).to(tl.int32), axis=1)
            in_run = (pos[:, None] >= starts[None, :]) & (pos[:, None] < ends_real[None, :])
            padding = tl.sum(in_run.to(tl.int32), axis=1) == 0
            tl.store(sorted_ids_ptr + pos, tl.zeros_like(pos) + num_entries, mask=mask & padding)
            tl.store(block_expert_ptr + pos // BLOCK_M, tl.minimum(expert, num_experts - 1),
                     mask=mask & (pos % BLOCK_M == 0))
        if pid == num_chunks:
            tl.store(num_padded_ptr, tl.sum(padded, axis=0))


# The align kernels work in steps of STEP entries (or positions) against all E_PAD experts at once: [STEP, E_PAD]
# one-hot tiles, at most _ALIGN_ELEMENTS. Small steps in many programs: at Qwen3-30B-A3B's 128 experts and up to
# 256 tokens, moe_align took 5-6.5 us in a CUDA graph on an H200 at 32-entry steps, 11-12 at 128 (the one-hot's
# cumsum dominates), and 10-200 us done by a single program (one launch, but serial).
_ALIGN_ELEMENTS = 4096
_ALIGN_MAX_STEP = 32
_ALIGN_PROGRAMS = 128  # at most this many chunks of entries, and as many slices of positions
_ALIGN_NUM_WARPS = 4
# Up to this many entries (decode batches of up to 8 tokens at k = 8) one chunk holds them all and the align
# kernel's programs count them themselves: one launch instead of two (TPOT -0.10 ms at the 30B-A3B shape, H200).
_ALIGN_ONE_LAUNCH_ENTRIES = 64


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]:
    """The entries e = t * k + j of topk_ids [T, k] grouped by expert, each expert's run padded to a multiple of
    block_m: (sorted_ids int32 [P], padding entries = T * k; block_expert int32 [P // block_m], the expert of
    each used block (blocks past the used ones hold E - 1); num_padded int32 [1], the used length), with
    P = `padded_size`. Entries of one expert keep their order. Two launches of static grids (one for up to
    _ALIGN_ONE_LAUNCH_ENTRIES entries) and no host synchronisation: CUDA graphs capture it."""
    device = topk_ids.device
    ids = topk_ids.reshape(-1)
    num_entries = ids.numel()
    size = padded_size(num_entries, num_experts, block_m)
    if num_entries == 0:
        empty = torch.empty((0,), dtype=torch.int32, device=device)
        return empty, empty, torch.zeros((1,), dtype=torch.int32, device=device)
    e_pad = max(16, triton.next_power_of_2(num_experts))
    step = max(16, min(_ALIGN_MAX_STEP, _ALIGN_ELEMENTS // e_pad))
    self_count = num_entries <= _ALIGN_ONE_LAUNCH_ENTRIES
    chunk_len = triton.cdiv(triton.cdiv(num_entries, step), 1 if self_count else _ALIGN_PROGRAMS) * step
    slice_len = triton.cdiv(triton.cdiv(size, step), _ALIGN_PROGRAMS) * step
    num_chunks = triton.cdiv(num_entries, chunk_len)
    sorted_ids = torch.empty((size,), dtype=torch.int32, device=device)
    block_expert = torch.empty((size // block_m,), dtype=torch.int32, device=device)
    num_padded = torch.empty((1,), dtype=torch.int32, device=device)
    counts = num_padded  # unused with self_count
    if not self_count:
        counts = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=device)
        _count_kernel[(num_chunks,)](ids, counts, num_entries, chunk_len, STEP=step, E_PAD=e_pad,
                                     num_warps=_ALIGN_NUM_WARPS)
    _align_kernel[(num_chunks + triton.cdiv(size, slice_len),)](
        ids, counts, sorted_ids, block_expert, num_padded, num_entries, num_experts, num_chunks, chunk_len, size,
        slice_len, BLOCK_M=block_m, STEP=step, E_PAD=e_pad, ROWS=max(1, min(64, 16384 // e_pad)),
        SELF_COUNT=self_count, num_warps=_ALIGN_NUM_WARPS,
    )
    return sorted_ids, block_expert, num_padded


@triton.jit
def _sum_topk_kernel(buf_ptr, out_ptr, H, stride_out, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                     ADD_TO_OUT: tl.constexpr):
    """out[t] = sum_j buf[t * k + j] in float32, in slot order (plus out[t] itself with ADD_TO_OUT: the residual
    stream), rounded once to out's dtype."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(buf_ptr + (token * TOP_K + j) * H + cols, mask=mask, other=0.0)
    if ADD_TO_OUT:
        acc += tl.load(out_ptr + token * stride_out + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _saturate_float16(v):
    """float32 v with its finite values clamped to float16's range, so that a large finite value does not become
    inf in float16; inf and NaN stay as they are."""
    clamped = tl.minimum(tl.maximum(v, -65504.0, propagate_nan=tl.PropagateNan.ALL), 65504.0,
                         propagate_nan=tl.PropagateNan.ALL)
    return tl.where(tl.abs(v) == float("inf"), v, clamped)


@triton.jit
def _to_float16_kernel(x_ptr, out_ptr, H, stride_x, BLOCK: tl.constexpr):
    """out [T, H] float16 = x [T, H], finite values saturated to float16's range (exact for bfloat16 x from 2^-17
    to 65504)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + cols, _saturate_float16(x).to(tl.float16), mask=mask)


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_t, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                         E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr):
    """One token's router: softmax over its E logits in float32, its TOP_K largest probabilities (the
    lowest-numbered of equal ones first, as layers/moe.py's `route`) and their experts, the probabilities
    renormalised to sum to one where asked. A row with a NaN or inf logit gets NaN weights (its output is not
    finite, as with the PyTorch math) and experts in range (so the GEMMs read only real weights)."""
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, E_PAD)
    logits = tl.load(logits_ptr + token * stride_t + experts, mask=experts < E, other=-float("inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    left = tl.where((experts < E) & (probs == probs), probs, -1.0)  # what may still be picked (NaN: last)
    slots = tl.arange(0, K_PAD)
    weights = tl.zeros((K_PAD,), dtype=tl.float32)
    ids = tl.zeros((K_PAD,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(left, axis=0)
        weights = tl.where(slots == j, tl.sum(tl.where(experts == best, probs, 0.0), axis=0), weights)
        ids = tl.where(slots == j, best, ids)
        left = tl.where(experts == best, -2.0, left)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    tl.store(weights_ptr + token * TOP_K + slots, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, ids, mask=slots < TOP_K)


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """layers/moe.py's `route` as one kernel (its PyTorch math is six launches a layer): (weights [T, k]
    float32, expert ids [T, k] int32)."""
    T, E = router_logits.shape
    if not 1 <= top_k <= E or router_logits.stride(1) != 1:
        raise ValueError(f"topk_softmax kernel: router logits {tuple(router_logits.shape)} stride "
                         f"{router_logits.stride()}, top_k {top_k}: need 1 <= top_k <= E and a unit last stride")
    weights = torch.empty((T, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=router_logits.device)
    if T:
        _topk_softmax_kernel[(T,)](router_logits, weights, ids, E, router_logits.stride(0), TOP_K=top_k,
                                   K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(E),
                                   RENORMALIZE=renormalize, num_warps=1)
    return weights, ids


# ----- launch heuristic -----


@dataclass(frozen=True)
class GemmConfig:
    """How one of the two launches tiles its work."""

    block_n: int  # output columns per program (the gated GEMM reads twice as many weight rows: gate and up)
    block_k: int
    num_warps: int
    num_stages: int


def choose_block_m(num_entries: int, num_experts: int) -> int:
    """Rows per block: by the mean rows per expert. Decode batches give most experts a handful of rows, and
    every block pads to block_m, so 16 (tl.dot's smallest); prefill batches fill 64-row blocks."""
    per_expert = num_entries / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def choose_config(block_m: int, N: int, K: int, gated: bool, fp8: bool = False) -> GemmConfig:
    """Tiles for an [entries, K] x [N, K]^T grouped GEMM at block_m rows per block.

    * 16-row blocks (decode): weight-bandwidth bound. Gated 32 columns (64 weight rows) x K steps of 128, 4
      stages; plain 128 x 128, 3 stages. On an H200 at Qwen3-30B-A3B's shapes these were the best or within
      2% of the best of 7 candidates each at T = 1, 64 and 256 (gated 12.5 / 179 / 205 us, plain 6.4 / 96 /
      108 us; ~4.4 TB/s at T = 64).
    * 32- and 64-row blocks (prefill): gated 64 x 64, plain 128 x 64, 3 stages, 4 warps: the best of 4-7
      candidates at T = 512, 1024, 2048 and 8192 (8 warps lost 10-20%). 128-row blocks were 5-10% faster at
      T = 8192 only.
    * fp8 weights: the same tiles, but 64 columns for the plain GEMM at 16-row blocks, 1-2.5 us faster per call
      at T = 1..256 (the best of 6-18 candidates each, `bench/moe_kernel.py --sweep fp8`; none of the others, K
      steps of 256 included, moved the gated GEMM by more than 1%). Swept while the weights were converted to
      bfloat16 (before the float16 path), not yet since.
    Each block size is clamped to the problem (at least 16, tl.dot's smallest)."""
    if block_m <= 16:
        block_n, block_k, num_warps, num_stages = (32, 128, 4, 4) if gated else ((64 if fp8 else 128), 128, 4, 3)
    else:
        block_n, block_k, num_warps, num_stages = (64 if gated else 128), 64, 4, 3
    block_n = min(block_n, max(16, triton.next_power_of_2(N)))
    block_k = min(block_k, max(16, triton.next_power_of_2(K)))
    return GemmConfig(block_n, block_k, num_warps, num_stages)


# ----- kernel -----


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [rows, K]: x (gated) or the intermediate (weighted)
    w_ptr,  # [E, N or 2N, K]
    out_ptr,  # [T * k, N]: the intermediate (x's dtype, or float16) or the float32 buffer
    sorted_ids_ptr,  # [P] int32 entries t * k + j by expert, padding = num_entries
    block_expert_ptr,  # [P // BLOCK_M] int32
    num_padded_ptr,  # [1] int32: used length of sorted_ids
    weights_ptr,  # [T * k] float32 routing weights (weighted only)
    scale_ptr,  # [E, N or 2N] float32 row scales of fp8 weights (HAS_SCALE only)
    N,
    K,
    num_entries,
    num_row_blocks,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    stride_se,
    ENTRIES_PER_ROW: tl.constexpr,  # k for x (entry // k is the token), 1 for the intermediate
    GATED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    OUT_SCALE: tl.constexpr,  # the product times this power of two (F16_HIDDEN_SCALE or its inverse), else 1.0
    SATURATE: tl.constexpr,  # a float16 intermediate: finite values clamped to its range
    HAS_SCALE: tl.constexpr,  # fp8 weights: converted to A's dtype as loaded, their row scales in the epilogue
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,  # dot in fp32: only for the CPU interpreter, whose bf16 dot is wrong
):
    # Grouped order: GROUP_M row blocks walk the column tiles together. Unused blocks are the last row blocks,
    # hence the last programs.
    pid = tl.program_id(0)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_row_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return

    entries = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = entries < num_entries
    rows = (entries // ENTRIES_PER_ROW).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    # the weight tile, read transposed: [BLOCK_K, BLOCK_N] of rows offs_n of W[expert] [N, K]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    up_offset = N * stride_wn  # the up rows follow the gate rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w_mask = mask_k[:, None] & mask_n[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if HAS_SCALE:
            w = w.to(a.dtype)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        # "ieee" keeps fp32 inputs exact (no TF32); it is ignored for 16-bit inputs.
        acc = tl.dot(a, w, acc, input_precision="ieee")
        if GATED:
            w_up = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0)
            if HAS_SCALE:
                w_up = w_up.to(a.dtype)
            if UPCAST:
                w_up = w_up.to(tl.float32)
            acc_up = tl.dot(a, w_up, acc_up, input_precision="ieee")
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if HAS_SCALE:
        scales = scale_ptr + expert * stride_se + offs_n
        acc = acc * tl.load(scales, mask=mask_n, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(scales + N, mask=mask_n, other=0.0)[None, :]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up
    if WEIGHTED:
        acc = acc * tl.load(weights_ptr + entries, mask=mask_m, other=0.0)[:, None]
    if OUT_SCALE != 1.0:
        acc = acc * OUT_SCALE
    if SATURATE:
        acc = _saturate_float16(acc)
    out_ptrs = out_ptr + entries.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _launch(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
            weights: torch.Tensor, entries_per_row: int, block_m: int, gated: bool,
            scale: torch.Tensor | None, out_scale: float = 1.0, saturate: bool = False) -> None:
    """One grouped GEMM: out[entry] = epilogue(A[entry // entries_per_row] @ W[expert of entry]^T) * out_scale,
    W times its row scales `scale` where it is fp8; `saturate`: finite values clamped to float16's range."""
    sorted_ids, block_expert, num_padded = align
    N, K = out.shape[1], a.shape[1]
    config = choose_config(block_m, N, K, gated, scale is not None)
    num_row_blocks = block_expert.numel()
    grid = (num_row_blocks * triton.cdiv(N, config.block_n),)
    _moe_gemm_kernel[grid](
        a, w, out, sorted_ids, block_expert, num_padded, weights, weights if scale is None else scale, N, K,
        out.shape[0], num_row_blocks, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        0 if scale is None else scale.stride(0),
        ENTRIES_PER_ROW=entries_per_row, GATED=gated, WEIGHTED=not gated, OUT_SCALE=out_scale, SATURATE=saturate,
        HAS_SCALE=scale is not None,
        BLOCK_M=block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=_GROUP_M, UPCAST=INTERPRETER,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


# ----- entry points -----


def supports(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None = None,
             w2_scale: torch.Tensor | None = None) -> bool:
    """Whether `fused_moe` takes these (else the caller runs the PyTorch math): x [T, H] with unit last stride,
    w13 [E, 2I, H] and w2 [E, H, I] with unit last strides, one device, x in a floating dtype the kernel handles
    and the weights in it too, or in float8_e4m3fn with float32 row scales [E, 2I] and [E, H] (both or neither)."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        return False
    E, two_i, H = w13.shape
    if (w13_scale is None) != (w2_scale is None):
        return False
    if w13_scale is None:
        weights_fit = w13.dtype == x.dtype and w2.dtype == x.dtype
    else:
        weights_fit = (w13.dtype == w2.dtype == torch.float8_e4m3fn and w13_scale.dtype == w2_scale.dtype ==
                       torch.float32 and tuple(w13_scale.shape) == (E, two_i) and tuple(w2_scale.shape) == (E, H)
                       and w13_scale.stride(1) == 1 and w2_scale.stride(1) == 1
                       and w13_scale.device == w2_scale.device == x.device)
    return (x.dtype in SUPPORTED_DTYPES and weights_fit and x.device == w13.device == w2.device
            and E > 0 and H > 0 and two_i > 0 and two_i % 2 == 0 and x.shape[1] == H
            and tuple(w2.shape) == (E, H, two_i // 2)
            and x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, residual: torch.Tensor | None = None, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * (silu(x[t] G_e^T) * x[t] U_e^T) D_e^T for e = topk_ids[t, j] -> [T, H] in x's
    dtype, where w13[e] = [G_e; U_e] and w2[e] = D_e (`fused_moe_math`'s semantics). topk_ids must lie in
    [0, E) (not checked: that would synchronise). With `residual` [T, H] (x's dtype): the sum is added to it in
    place, in float32 and rounded once, and `residual` returned. fp8 weights (`w13_scale`, `w2_scale`: float32
    row scales) are converted to x's dtype as they are loaded, and each product scaled by its row's scale in
    float32 (weight-only fp8, as the skinny kernel's); for a bfloat16 x the GEMMs multiply in float16, x and the
    intermediate within float16's range (the module docstring says how)."""
    if not supports(x, w13, w2, w13_scale, w2_scale):
        raise ValueError(f"fused_moe kernel: unsupported x {tuple(x.shape)} {x.dtype} stride {x.stride()} on "
                         f"{x.device}, w13 {tuple(w13.shape)} {w13.dtype} stride {w13.stride()} on {w13.device}, "
                         f"w2 {tuple(w2.shape)} {w2.dtype} stride {w2.stride()} on {w2.device}, scales "
                         f"{[None if t is None else (tuple(t.shape), t.dtype) for t in (w13_scale, w2_scale)]}: need "
                         f"x [T, H], w13 [E, 2I, H], w2 [E, H, I] of one dtype in {SUPPORTED_DTYPES} (or fp8 weights "
                         f"with float32 scales [E, 2I], [E, H]), unit last strides")
    T, H = x.shape
    E, intermediate = w13.shape[0], w2.shape[2]
    if (topk_ids.dim() != 2 or topk_ids.shape[0] != T or not 1 <= topk_ids.shape[1] <= E
            or topk_weights.shape != topk_ids.shape):
        raise ValueError(f"fused_moe kernel: topk_weights {tuple(topk_weights.shape)} and topk_ids "
                         f"{tuple(topk_ids.shape)} must both be [T, k] with T = {T} and 1 <= k <= E = {E}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_weights.is_floating_point():
        raise ValueError(f"fused_moe kernel: topk_ids must be int32/int64 and topk_weights floating, got "
                         f"{topk_ids.dtype} and {topk_weights.dtype}")
    if topk_ids.device != x.device or topk_weights.device != x.device:
        raise ValueError(f"fused_moe kernel: topk_ids on {topk_ids.device}, topk_weights on {topk_weights.device}, "
                         f"x on {x.device}")
    if residual is not None and (residual.shape != (T, H) or residual.dtype != x.dtype or residual.stride(1) != 1
                                 or residual.device != x.device):
        raise ValueError(f"fused_moe kernel: residual {tuple(residual.shape)} {residual.dtype} stride "
                         f"{residual.stride()} on {residual.device}: need [{T}, {H}] {x.dtype}, unit last stride")
    if T == 0:
        return x.new_empty((0, H)) if residual is None else residual
    top_k = topk_ids.shape[1]
    num_entries = T * top_k
    block_m = choose_block_m(num_entries, E)
    align = moe_align(topk_ids, E, block_m)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    block = min(_SUM_BLOCK, triton.next_power_of_2(H))  # columns per program of the row-wise kernels
    a, hidden_scale = x, 1.0
    f16 = w13_scale is not None and x.dtype == torch.bfloat16  # fp8 experts multiply in float16 (module docstring)
    if f16:
        a, hidden_scale = torch.empty((T, H), dtype=torch.float16, device=x.device), F16_HIDDEN_SCALE
        _to_float16_kernel[(T, triton.cdiv(H, block))](x, a, H, x.stride(0), BLOCK=block, num_warps=4)
    hidden = torch.empty((num_entries, intermediate), dtype=a.dtype, device=x.device)
    _launch(a, w13, hidden, align, weights, top_k, block_m, gated=True, scale=w13_scale, out_scale=hidden_scale,
            saturate=f16)
    buf = torch.empty((num_entries, H), dtype=torch.float32, device=x.device)
    _launch(hidden, w2, buf, align, weights, 1, block_m, gated=False, scale=w2_scale, out_scale=1.0 / hidden_scale)
    out = torch.empty((T, H), dtype=x.dtype, device=x.device) if residual is None else residual
    _sum_topk_kernel[(T, triton.cdiv(H, block))](buf, out, H, out.stride(0), TOP_K=top_k, BLOCK=block,
                                                 ADD_TO_OUT=residual is not None, num_warps=4)
    return out
