"""Triton sampler for the common case: token ~ softmax(logits / T), one uniform per row.

Inverse-CDF sampling in two launches, reading the logits once in full:

1. grid (rows, chunks): each program reduces one slice of a row to its max
   m_c = max(z) and s_c = sum(exp(z - m_c)), z = logit / T in float32 (bf16 or
   fp16 logits are upcast on load). Slicing the row lets batch 1 spread over
   many SMs.
2. grid (rows,): weighs the slices, w_c = s_c * exp(m_c - M) with M = max m_c,
   picks the slice where the cumulative sum of w first exceeds u * sum(w), and
   scans only that slice with a running sum of exp(z - M) for the token.

The exponential race it replaces on CUDA draws one random number per
vocabulary entry; this draws one per row (`uniform`, made by the caller with
`torch.rand`, so `torch.manual_seed` reproduces it and CUDA graphs can hold it).
Comparisons are strict and a candidate must have p > 0, so a token with
probability 0 (logit -inf) is never chosen, whatever the rounding; when
rounding leaves the target past the recomputed sums, the last slice / token
with non-zero weight is taken. A row whose logits are all -inf yields token 0
(as argmax would). Temperatures must be > 0 (not checked on the device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_CHUNKS = 64  # slices per row at most (kernel 2 loads them as one block)
MIN_TILE = 256  # a slice is at least one tile: smaller ones cost more in programs than they spread
MAX_TILE = 1024  # elements loaded per loop step


@triton.jit
def _chunk_stats_kernel(
    logits_ptr,
    temperature_ptr,
    max_ptr,  # [rows, MAX_CHUNKS] fp32
    sum_ptr,  # [rows, MAX_CHUNKS] fp32
    stride_row,
    vocab,
    width,  # slice width, a multiple of TILE
    MAX_CHUNKS: tl.constexpr,
    TILE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    start = chunk * width
    end = tl.minimum(start + width, vocab)
    base = logits_ptr + row * stride_row
    lanes = tl.arange(0, TILE)
    m = tl.full([], -float("inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    for offset in range(0, width, TILE):
        cols = start + offset + lanes
        x = tl.load(base + cols, mask=cols < end, other=-float("inf")).to(tl.float32)
        z = x / temperature
        m_new = tl.maximum(m, tl.max(z, 0))
        # While everything so far is -inf, subtract 0 instead: exp(-inf) = 0, never exp(nan).
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(z - m_safe), 0)
        m = m_new
    tl.store(max_ptr + row * MAX_CHUNKS + chunk, m)
    tl.store(sum_ptr + row * MAX_CHUNKS + chunk, s)


@triton.jit
def _pick_token_kernel(
    logits_ptr,
    temperature_ptr,
    uniform_ptr,
    max_ptr,
    sum_ptr,
    out_ptr,  # [rows] int64
    stride_row,
    vocab,
    width,
    num_chunks,
    MAX_CHUNKS: tl.constexpr,
    TILE: tl.constexpr,
    NONE: tl.constexpr,  # 'no token found': above any index
):
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + row)
    u = tl.load(uniform_ptr + row)

    # The slice: the first whose inclusive cumulative weight exceeds u * total.
    chunks = tl.arange(0, MAX_CHUNKS)
    valid = chunks < num_chunks
    m = tl.load(max_ptr + row * MAX_CHUNKS + chunks, mask=valid, other=-float("inf"))
    s = tl.load(sum_ptr + row * MAX_CHUNKS + chunks, mask=valid, other=0.0)
    big_max = tl.max(m, 0)
    big_max = tl.where(big_max == -float("inf"), 0.0, big_max)  # a row of only -inf: no nan below
    w = tl.where(m == -float("inf"), 0.0, s * tl.exp(m - big_max))
    cum = tl.cumsum(w, 0)
    target = u * tl.max(cum, 0)  # the scan's own total, so u < 1 leaves the target below it
    chunk = tl.min(tl.where((cum > target) & (w > 0), chunks, MAX_CHUNKS), 0)
    if chunk == MAX_CHUNKS:  # rounding put the target past every sum: the last slice with weight
        chunk = tl.max(tl.where(w > 0, chunks, 0), 0)
    remaining = target - tl.max(tl.where(chunks < chunk, cum, 0.0), 0)

    # The token: the first in the slice whose running sum of exp(z - M) exceeds what remains.
    start = chunk * width
    end = tl.minimum(start + width, vocab)
    base = logits_ptr + row * stride_row
    lanes = tl.arange(0, TILE)
    running = tl.full([], 0.0, tl.float32)
    token = tl.full([], NONE, tl.int32)
    for offset in range(0, width, TILE):
        cols = start + offset + lanes
        x = tl.load(base + cols, mask=cols < end, other=-float("inf")).to(tl.float32)
        p = tl.exp(x / temperature - big_max)
        hit = (running + tl.cumsum(p, 0) > remaining) & (p > 0)
        token = tl.minimum(token, tl.min(tl.where(hit, cols, NONE), 0))
        running += tl.sum(p, 0)
    if token == NONE:  # rounding again (or u = 1): the last token of the slice with p > 0
        token = tl.full([], 0, tl.int32)  # stays 0 for a row of only -inf, as argmax would
        for offset in range(0, width, TILE):
            cols = start + offset + lanes
            x = tl.load(base + cols, mask=cols < end, other=-float("inf")).to(tl.float32)
            p = tl.exp(x / temperature - big_max)
            token = tl.maximum(token, tl.max(tl.where(p > 0, cols, 0), 0))
    tl.store(out_ptr + row, token.to(tl.int64))


def _plan(vocab: int) -> tuple[int, int, int]:
    """(tile, slice width, number of slices) for a row of `vocab` entries."""
    per_chunk = triton.cdiv(vocab, MAX_CHUNKS)
    tile = min(MAX_TILE, max(MIN_TILE, triton.next_power_of_2(per_chunk)))
    width = triton.cdiv(per_chunk, tile) * tile
    return tile, width, triton.cdiv(vocab, width)


def sample_from_logits(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Row r's token drawn from softmax(logits[r] / temperature[r]) by inverse CDF at uniform[r].

    logits: [rows, vocab] float32, bfloat16 or float16 (last dimension contiguous);
    temperature: [rows] float32, > 0; uniform: [rows] float32 in [0, 1). Returns [rows] int64.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    for name, t in (("temperature", temperature), ("uniform", uniform)):
        if t.shape != (rows,):
            raise ValueError(f"{name} must have shape [{rows}] (one per logits row), got {tuple(t.shape)}")
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device} but logits are on {logits.device}")
    if vocab == 0:
        raise ValueError("logits must have at least one vocabulary entry")
    if vocab > 1 and logits.stride(1) != 1:
        raise ValueError("logits need a contiguous last (vocab) dimension")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    temperature = temperature.contiguous()
    uniform = uniform.contiguous()
    tile, width, num_chunks = _plan(vocab)
    chunk_max = torch.empty(rows, MAX_CHUNKS, dtype=torch.float32, device=logits.device)
    chunk_sum = torch.empty_like(chunk_max)
    stride_row = logits.stride(0)
    _chunk_stats_kernel[(rows, num_chunks)](
        logits, temperature, chunk_max, chunk_sum, stride_row, vocab, width,
        MAX_CHUNKS=MAX_CHUNKS, TILE=tile, num_warps=4,
    )
    _pick_token_kernel[(rows,)](
        logits, temperature, uniform, chunk_max, chunk_sum, out, stride_row, vocab, width, num_chunks,
        MAX_CHUNKS=MAX_CHUNKS, TILE=tile, NONE=2**31 - 1, num_warps=4,
    )
    return out
