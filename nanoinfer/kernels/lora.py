"""LoRA's expand with the slot mask in one kernel: out += (each token's shrunk row, kept only in its own adapter
slot's columns) B^T, added into `out` in place.

The PyTorch path (lora/layers.py) zeroes other slots' columns of the shrunk rows with a one-hot mask and then runs
an addmm: two kernels where this is one. At decode sizes each is a few microseconds of mostly fixed cost, and a layer adapts
four projections, so the mask kernel alone is ~0.3 ms of a step (bench/RESULTS.md). The math is the same: the
products of the kept columns summed in float32 with `out`, rounded once.

`shrunk` is [T, width] with width = subs x slots x rank, column c belonging to slot (c % (slots x rank)) // rank
(layers.py's layout); B is [N, width], block diagonal over the sub-projections; `token_slots` holds each token's
slot (-1: no adapter: its rows get nothing)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoinfer.kernels import INTERPRETER


@triton.jit
def _lora_expand_kernel(shrunk_ptr, b_ptr, slots_ptr, out_ptr, num_tokens, n, width, stride_s, stride_b, stride_o,
                        SLOT_WIDTH: tl.constexpr, RANK: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < num_tokens, cols < n
    slot = tl.load(slots_ptr + rows, mask=row_ok, other=-1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < width
        own = ((ks % SLOT_WIDTH) // RANK)[None, :] == slot[:, None]
        a = tl.load(shrunk_ptr + rows[:, None].to(tl.int64) * stride_s + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :] & own, other=0.0)
        b = tl.load(b_ptr + cols[None, :].to(tl.int64) * stride_b + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)
        if UPCAST:  # the CPU interpreter's bf16 dot is wrong (kernels/__init__.py)
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    out = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (out.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


def lora_expand(out: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
                num_slots: int, rank: int) -> torch.Tensor:
    """out [T, N] += mask(shrunk [T, width]) @ lora_b [N, width]^T, in place (returned)."""
    num_tokens, width = shrunk.shape
    n = out.shape[1]
    if out.stride(1) != 1 or shrunk.stride(1) != 1 or lora_b.stride(1) != 1 or lora_b.shape != (n, width):
        raise ValueError(f"lora_expand: out {tuple(out.shape)} stride {out.stride()}, shrunk {tuple(shrunk.shape)} "
                         f"stride {shrunk.stride()}, B {tuple(lora_b.shape)} stride {lora_b.stride()}")
    if num_tokens == 0:
        return out
    block_m = 16 if num_tokens <= 16 else 64
    block_n = 64 if num_tokens <= 16 else 128
    block_k = min(64, max(16, triton.next_power_of_2(width)))
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(n, block_n))
    _lora_expand_kernel[grid](shrunk, lora_b, token_slots, out, num_tokens, n, width, shrunk.stride(0),
                              lora_b.stride(0), out.stride(0), SLOT_WIDTH=num_slots * rank, RANK=rank,
                              DOT_PRECISION="ieee" if out.dtype == torch.float32 or INTERPRETER else "tf32",
                              UPCAST=out.dtype == torch.bfloat16 and INTERPRETER,
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out
