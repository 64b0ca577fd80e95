"""L2 prefetch of a decode GEMM's weights while a latency-bound kernel runs.

A decode step at small batches alternates kernels that stream weights from HBM at
full bandwidth (the matmuls) with kernels that wait on latency and read almost
nothing: the tensor-parallel all-reduce (an NVLink round trip), the norms. During the
latter HBM idles. `prefetch_l2` is launched right before such a kernel and asks the
L2 cache to fetch the first part of the *next* matmul's weights, so that matmul starts
with that part in L2 (the H200's L2 holds 50 MB; a decode matmul's shard is 8-100 MB).

The part must be a uniform fraction of every program's work, not the first bytes of
the matrix: the skinny kernel's programs all start at once and each walks its own
rows over its own K range (`SkinnyConfig.k_per_split`), so its time is the slowest
program's. The plan (`prefetch_plan`) is therefore the first `length` elements of
each (row, K split) range, with `length` sized from a byte budget.

The kernel (one bulk L2 prefetch, `cp.async.bulk.prefetch.L2`, per range; sm_90)
waits for the previous kernel to finish (its weights must not be evicted by ours while
it still streams), then releases the next one (PDL) and issues the prefetches, which
do not hold the kernel: it ends as soon as they are issued. It writes nothing, so the
next kernel's wait for it, like its own for the previous one, orders only time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanoinfer.kernels import pdl_enabled

_LINE = 128  # bytes: an L2 line; every range is a whole number of them
_ALIGN = 16  # bytes: a bulk prefetch's address and size must be multiples of it
# Bytes asked for per window (NANOINFER_L2_PREFETCH_MB; 0 turns prefetching off): what HBM
# moves in a few microseconds, well inside L2 (bench/prefetch.py, bench/NOTES.md).
BUDGET_BYTES = int(float(os.environ.get("NANOINFER_L2_PREFETCH_MB", "16")) * 2**20)
_PROGRAMS = 16
_BLOCK = 128  # ranges per program per step: one per thread (4 warps)


@dataclass(frozen=True)
class PrefetchPlan:
    """`rows` x `splits` ranges of `length` elements, range (r, s) starting at element
    r * row_stride + s * split_stride of the weight."""

    rows: int
    splits: int
    row_stride: int
    split_stride: int
    length: int

    @property
    def num_ranges(self) -> int:
        return self.rows * self.splits


def prefetch_plan(weight: torch.Tensor, split_k: int, k_per_split: int, budget_bytes: int) -> PrefetchPlan | None:
    """The first elements of each (row, K split) range of `weight` [N, K], as many as fit the
    byte budget in whole L2 lines; None if not one line per range fits or a range would not
    start 16-byte aligned."""
    N, K = weight.shape
    elt = weight.element_size()
    line = _LINE // elt
    if weight.stride(1) != 1 or (weight.stride(0) * elt) % _ALIGN or (k_per_split * elt) % _ALIGN \
            or weight.data_ptr() % _ALIGN:
        return None
    shortest = min(k_per_split, K - (split_k - 1) * k_per_split)  # the last split may be short
    length = min(budget_bytes // (N * split_k * elt) // line * line, shortest)
    if length < line:
        return None
    return PrefetchPlan(rows=N, splits=split_k, row_stride=weight.stride(0), split_stride=k_per_split,
                        length=length)


@triton.jit
def _prefetch_l2_kernel(base, num_ranges, row_stride, split_stride, nbytes, SPLITS: tl.constexpr,
                        ELT: tl.constexpr, BLOCK: tl.constexpr):
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    for start in range(pid * BLOCK, num_ranges, tl.num_programs(0) * BLOCK):
        r = start + tl.arange(0, BLOCK)
        # Ranges past the end prefetch range 0 again (harmless) rather than branch per thread.
        r = tl.where(r < num_ranges, r, 0).to(tl.int64)
        address = base + ((r // SPLITS) * row_stride + (r % SPLITS) * split_stride) * ELT
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;",
            "=r,l,r", [address, nbytes + tl.zeros([BLOCK], tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(weight: torch.Tensor, plan: PrefetchPlan) -> None:
    """Launch the prefetch of `plan`'s ranges of `weight` (CUDA, sm_90 and newer, with PDL)."""
    programs = min(_PROGRAMS, triton.cdiv(plan.num_ranges, _BLOCK))
    _prefetch_l2_kernel[(programs,)](
        weight.data_ptr(), plan.num_ranges, plan.row_stride, plan.split_stride, plan.length * weight.element_size(),
        SPLITS=plan.splits, ELT=weight.element_size(), BLOCK=_BLOCK, num_warps=4, launch_pdl=True)


def prefetch_for(weight: torch.Tensor, split_k: int, k_per_split: int) -> None:
    """Prefetch the first BUDGET_BYTES of what a skinny matmul with this K split reads of
    `weight`, where the GPU has the instruction (sm_90, PDL on)."""
    if BUDGET_BYTES <= 0 or not pdl_enabled(weight.device):
        return
    plan = prefetch_plan(weight, split_k, k_per_split, BUDGET_BYTES)
    if plan is not None:
        prefetch_l2(weight, plan)
