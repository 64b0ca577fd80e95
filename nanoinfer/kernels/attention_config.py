"""Launch shapes for the paged-attention kernel (kernels/paged_attention.py), chosen from a step's host ints
only (no device sync, so a decode step can be captured in a CUDA graph): tile sizes, warps, the register cap,
and for decode how many splits cut each context and how they are sized. The constants come from
`bench/kernels.py` sweeps on an H200 (bench/RESULTS.md)."""

from __future__ import annotations

import os
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


# Decode splits the context while sequences x KV heads leave the SMs short of
# about 4 resident programs each, into pieces of at least one BLOCK_N step.
# Tile shapes and both constants come from bench/kernels.py sweeps on an H200.
_SPLIT_TARGET_PROGRAMS_PER_SM = 4
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


# Balanced splits (NANOINFER_BALANCED_SPLITS=<programs per SM>, off until measured on the reference workload,
# bench/NOTES.md): a launch's splits are sized for that many programs per SM over its total context. The grid
# gets enough splits for a sequence of up to _BALANCE_SKEW x the mean context to reach that size.
_BALANCE_SKEW = 2


def balanced_programs_per_sm() -> int:
    value = os.environ.get("NANOINFER_BALANCED_SPLITS", "") or "0"
    if not value.isdigit():
        raise ValueError(f"NANOINFER_BALANCED_SPLITS must be a number of programs per SM (0: off), got {value!r}")
    return int(value)


def _decode_num_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """Power of two (few compiled variants, stable CUDA-graph buckets)."""
    wanted = _SPLIT_TARGET_PROGRAMS_PER_SM * num_sms // max(num_programs, 1)
    if balanced_programs_per_sm():
        wanted = max(wanted, _BALANCE_SKEW * balanced_programs_per_sm() * num_sms // max(num_programs, 1))
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
        balance = balanced_programs_per_sm() if num_splits > 1 else 0
        if balance:
            config = replace(config, balance_programs=balance * num_sms)
        if cache_dtype == torch.float8_e4m3fn:
            # The register cap where more than 4 programs per SM are to run at once: a wide unsplit grid,
            # or balanced splits aimed at more (uncapped, the fp8 kernel takes ~210 registers: 4 per SM).
            if (num_seqs * num_kv_heads if num_splits == 1 else balance * num_sms) > \
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
