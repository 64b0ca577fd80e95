"""Launch shapes for the paged-attention kernel (kernels/paged_attention.py), chosen from a step's host ints
only (no device sync, so a decode step can be captured in a CUDA graph): tile sizes, warps, the register cap,
and for decode how many splits cut each context and how they are sized. The constants come from
`bench/kernels.py` sweeps on an H200 (bench/RESULTS.md)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton


@dataclass(frozen=True)
class PagedAttentionConfig:
    """How one launch tiles the work; `choose_config` picks it from host ints."""

    decode: bool  # one program per (sequence, KV head, split); needs max_query_len <= 1
    block_q: int  # query tokens per tile
    block_m: int  # tile rows: block_q * query heads per KV head, padded to a power of two >= 16
    block_n: int  # context tokens per inner step (several cache blocks)
    num_splits: int  # > 1: split the context (decode only); the last split to finish merges
    num_warps: int
    num_stages: int
    max_registers: int | None = None  # ptxas's cap per thread: more programs resident per SM
    # > 0 (split decode only): splits of a launch are at least total context x KV heads / balance_programs
    # tokens long, so long sequences split more than short ones and the programs carry similar work.
    balance_programs: int = 0


# Decode splits are at least one BLOCK_N step long, at most MAX_SPLITS per context (balanced splits, below,
# decide how many). Tile shapes and constants come from bench/kernels.py sweeps on an H200.
MAX_SPLITS = 32
DECODE_BLOCK_N = 64
# An fp8 cache, unsplit decode (bench/RESULTS.md, H200): the fp8 kernel is bound by latency at 2 warps per
# scheduler (ncu: 4 resident programs per SM, by registers and shared memory alike). While the grid fits the SMs
# at 4 programs each, 128-token steps are fastest (5-9% over 64); a larger grid takes 64-token steps (22.8 KB of
# shared memory) capped at 128 registers, 8 resident programs per SM: batch 256 x 1000 199 -> 173 us, batch 80
# (640 programs, a second wave of 128-token programs) x 1000 / 1500 87 / 128 -> 66 / 95 us.
_FP8_DECODE_BLOCK_N = 128
_FP8_WIDE_GRID_PROGRAMS_PER_SM = 4
_FP8_WIDE_GRID_REGISTERS = 128
_PREFILL_TILE_ROWS = 64  # query tokens x query heads per tile


# Balanced splits: while sequences x KV heads leave the SMs short of _BALANCE_PROGRAMS_PER_SM programs each,
# decode splits the context, each split at least (the launch's total context x KV heads / that many programs)
# long, so in a batch of unequal contexts long sequences split and short ones do not. The grid gets enough
# splits for a sequence of up to _BALANCE_SKEW x the mean context to reach that size. On the reference workload
# with longest-first launches (H200, fp8): 29.9-30.0k -> 30.4-30.5k tok/s against 4 programs per SM with
# equal splits per sequence (bench/RESULTS.md).
_BALANCE_PROGRAMS_PER_SM = 8
_BALANCE_SKEW = 2


def _decode_num_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """Power of two (few compiled variants, stable CUDA-graph buckets)."""
    wanted = _BALANCE_SKEW * _BALANCE_PROGRAMS_PER_SM * num_sms // max(num_programs, 1)
    splits = max(1, min(wanted, triton.cdiv(max_seq_len, DECODE_BLOCK_N), MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


def choose_config(
    *,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    max_query_len: int,
    num_seqs: int,
    max_seq_len: int,
    num_sms: int,
    cache_dtype: torch.dtype | None = None,  # None: dtype
) -> PagedAttentionConfig:
    """Launch shape from the step's host-side sizes (no device sync)."""
    group = num_heads // num_kv_heads
    if max_query_len <= 1:
        num_splits = _decode_num_splits(num_seqs * num_kv_heads, max_seq_len, num_sms)
        config = PagedAttentionConfig(
            decode=True,
            block_q=1,
            block_m=max(16, triton.next_power_of_2(group)),
            block_n=DECODE_BLOCK_N,
            num_splits=num_splits,
            num_warps=2,
            num_stages=3,
        )
        if num_splits > 1:
            config = replace(config, balance_programs=_BALANCE_PROGRAMS_PER_SM * num_sms)
        if cache_dtype == torch.float8_e4m3fn:
            # The register cap where more than 4 programs per SM are to run at once: a wide unsplit grid,
            # or balanced splits (aimed at 8; uncapped, the fp8 kernel takes ~210 registers: 4 per SM).
            if (num_seqs * num_kv_heads if num_splits == 1 else config.balance_programs) > \
                    _FP8_WIDE_GRID_PROGRAMS_PER_SM * num_sms:
                return replace(config, max_registers=_FP8_WIDE_GRID_REGISTERS)
            if num_splits == 1:
                return replace(config, block_n=_FP8_DECODE_BLOCK_N)
        return config
    block_q = min(triton.next_power_of_2(max_query_len), max(1, _PREFILL_TILE_ROWS // group))
    return PagedAttentionConfig(
        decode=False,
        block_q=block_q,
        block_m=max(16, triton.next_power_of_2(block_q * group)),
        block_n=32 if dtype == torch.float32 else 64,
        num_splits=1,
        num_warps=4,
        num_stages=2,
    )


def max_splits(config: PagedAttentionConfig) -> int:
    """The kernel's split axis for merging: one compiled size for every split count up to MAX_SPLITS."""
    return max(MAX_SPLITS, triton.next_power_of_2(config.num_splits))


# The split merge's tile: query heads x splits per step of its loop, 32 rows of head_dim floats (64 registers a
# thread at head_dim 128 and the decode kernel's 2 warps, as one head's 32 splits took when it merged per head);
# 16 under a register cap (the fp8 kernel's: at 32 rows ptxas gave its KV loop 3% more moves at GQA 2, sm_90 SASS).
_MERGE_ROWS = 32
_MERGE_ROWS_CAPPED = 16
_MERGE_MAX_HEADS = 16


def merge_tile(query_group: int, max_registers: int | None = None) -> tuple[int, int]:
    """(query heads, splits) the split merge combines per step: the whole GQA group at once, up to 16 heads, and
    half the splits under a register cap (`max_registers`, as the launch passes it to ptxas)."""
    heads = min(triton.next_power_of_2(query_group), _MERGE_MAX_HEADS)
    return heads, max(1, (_MERGE_ROWS_CAPPED if max_registers else _MERGE_ROWS) // heads)
