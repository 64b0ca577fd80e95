"""Skinny matmul for decode: `y = x @ W^T + b` with few rows (M <= 16), or, with a residual,
`h += x @ W^T + b` in place (the row-parallel layers' residual add, in the epilogue).

At decode batch sizes a linear layer is a matrix-vector product: the whole
weight is read once to produce a handful of output rows, so its time is the
weight's bytes over the bandwidth the kernel reaches. cuBLAS's M=1 kernels
reach ~1.3 TB/s on an H200 (of ~4.3-4.8) on the 4-12 MB matrices of a small
model, mostly because they launch too few CTAs, or split K and add a second
reduction kernel.

Design:

* One program owns BLOCK_N output columns (weight rows) for all M rows and
  walks K in BLOCK_K steps. The weight tile [BLOCK_N, BLOCK_K] is loaded
  along the weight's contiguous K axis (512 bytes per row per step for 16-bit
  types: fully coalesced, 16-byte vector loads).
* The product is a `tl.dot` of the x tile, padded to 16 rows (the smallest
  tensor-core tile; rows >= M are masked, so they cost no memory traffic), by
  the transposed weight tile, accumulated in fp32. At M=1 this wastes 15/16 of
  the tensor-core work, but the matmul is memory bound by two orders of
  magnitude, and `tl.dot` makes Triton stage the loads through shared memory
  with cp.async software pipelining (`num_stages` tiles in flight per
  program), which is what keeps enough bytes in flight. A broadcast-multiply
  and sum would need an [M, BLOCK_N, BLOCK_K] register tile (spills at
  M=16) and gets no such pipelining for free.
* The grid must fill the SMs even when N is small (N=1024 at BLOCK_N=16 is 64
  programs for 132 SMs), so K may be split into SPLIT_K ranges. Each program
  stores its fp32 partial into a workspace and bumps a per-column-tile
  arrival counter; the last program to arrive sums the SPLIT_K partials in
  split order (deterministic regardless of arrival order), adds the bias (and
  the residual), writes the output and resets the counter to 0 for the next
  launch. So a split launch is still one kernel: no zero-fill, no second
  reduction kernel, no fp32-to-bf16 cast kernel. The counters are
  `arrival_counters`, shared with split-KV attention.
* fp8 weights (layers/fp8.py) are loaded as they are stored (half the bytes of bf16), converted to x's
  dtype in registers before the dot (to bf16 on Hopper by `e4m3_to_bf16`'s bit operations, 13% faster
  than Triton's conversion), and each column's scale multiplies the fp32 sum in the epilogue.
* On Hopper it launches with programmatic dependent launch (`pdl_enabled`): its
  programs start while the previous kernel finishes and wait only before loading x;
  they release the next kernel once their K loop is done.
* Launch parameters are pure functions of host ints: `choose_config(M, N, K,
  num_sms, dtype)`, the heuristic, and `candidate_configs`, the few configs
  the start-up tuning times per shape (no Triton autotuning: it would re-tune
  inside CUDA graph capture). `bench/kernels.py --gemm` sweeps the alternatives.

Dispatch (layers/skinny_dispatch.py, free of triton): `linear(x, weight, bias, residual)` is what the
model's linear layers call. It uses the skinny kernel only when enabled (`set_skinny_gemm`, on CUDA
without enforce_eager), x is 2-D on CUDA with 1 <= M <= 16, and the choice
table holds a config for this (M bucket, N, K, dtype): the fastest candidate, where it beat
cuBLAS. `tune_skinny_gemm` fills the table once at start-up, timing inside CUDA graphs.
Everything else (CPU, prefill, large batches) is `F.linear`, or `residual.addmm_` with a residual.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanoinfer.distributed.parallel_state import tp_rank0_object
from nanoinfer.kernels import INTERPRETER, arrival_counters, num_sms, pdl_enabled
from nanoinfer.layers import skinny_dispatch
from nanoinfer.layers.fp8 import FP8_DTYPE, dequantized
from nanoinfer.layers.skinny_dispatch import MAX_M

logger = logging.getLogger("nanoinfer")

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# ----- launch heuristic (retune from `bench/kernels.py --gemm` on the GPU) -----

_BLOCK_M = 16  # tl.dot's smallest tile; x rows >= M are masked
_ROW_BYTES_PER_STEP = 512  # weight bytes per row per K step: BLOCK_K = 256 for 16-bit types
_MAX_SPLIT_K = 16
_MAX_STAGES = 4
_NUM_WARPS = 4


@dataclass(frozen=True)
class SkinnyConfig:
    """How one launch tiles the work; `choose_config` picks it from host ints."""

    block_n: int  # output columns (weight rows) per program
    block_k: int  # K per step
    split_k: int  # K ranges per column tile (> 1: last-arriver reduction)
    num_warps: int
    num_stages: int
    block_m: int = _BLOCK_M

    def k_per_split(self, K: int) -> int:
        """K covered by one split: a whole number of BLOCK_K steps."""
        return triton.cdiv(triton.cdiv(K, self.block_k), self.split_k) * self.block_k

    def grid(self, N: int) -> tuple[int, int]:
        return triton.cdiv(N, self.block_n), self.split_k


def _has_empty_split(split: int, k_steps: int) -> bool:
    """Whether cutting k_steps K steps into `split` whole-step ranges leaves the last one empty."""
    return (split - 1) * triton.cdiv(k_steps, split) >= k_steps


def _fill_split(tiles: int, k_steps: int, num_sms: int) -> int:
    """The smallest power-of-two split giving at least one program per SM, while every split keeps
    at least one K step (no empty split)."""
    split = 1
    while tiles * split < num_sms and split < _MAX_SPLIT_K and not _has_empty_split(2 * split, k_steps):
        split *= 2
    return split


def _config(block_n: int, block_k: int, split: int, k_steps: int) -> SkinnyConfig:
    """num_stages: up to _MAX_STAGES tiles in flight per program, fewer when a split has fewer
    steps (less shared memory, more programs resident per SM)."""
    return SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split, num_warps=_NUM_WARPS,
                        num_stages=max(2, min(_MAX_STAGES, triton.cdiv(k_steps, split) + 1)))


def _block_k(row_bytes: int, K: int, dtype: torch.dtype) -> int:
    """K per step: `row_bytes` of each weight row, clamped to K (and at least tl.dot's 16)."""
    return max(16, min(row_bytes // torch.empty((), dtype=dtype).element_size(), triton.next_power_of_2(K)))


def choose_config(M: int, N: int, K: int, num_sms: int, dtype: torch.dtype = torch.bfloat16) -> SkinnyConfig:
    """Launch shape for an [M, K] x [N, K]^T product.

    * BLOCK_K: 512 bytes of each weight row per step (clamped to K).
    * BLOCK_N = 16 for M <= 8, else 32: the x tile is re-read from L2 by every
      program, M rows against BLOCK_N weight rows per step, so keep it at most
      half the weight traffic. Small tiles also mean many programs.
    * SPLIT_K: the smallest power of two giving at least one program per SM,
      while every split keeps at least one K step (no empty split).
    * num_stages: up to 4 tiles in flight per program, fewer when a split has
      fewer steps (less shared memory, more programs resident per SM).
    """
    if not 1 <= M <= MAX_M:
        raise ValueError(f"skinny GEMM is for 1 <= M <= {MAX_M} rows, got M={M}")
    if N < 1 or K < 1:
        raise ValueError(f"N and K must be positive, got N={N}, K={K}")
    block_k = _block_k(_ROW_BYTES_PER_STEP, K, dtype)
    block_n = min(16 if M <= 8 else 32, max(16, triton.next_power_of_2(N)))
    tiles, k_steps = triton.cdiv(N, block_n), triton.cdiv(K, block_k)
    return _config(block_n, block_k, _fill_split(tiles, k_steps, num_sms), k_steps)


def candidate_configs(M: int, N: int, K: int, num_sms: int, dtype: torch.dtype = torch.bfloat16) -> list[SkinnyConfig]:
    """What the start-up tuning times for one shape: the heuristic's config, and 32-column tiles
    with half-size K steps at the heuristic's split rule and at twice that split. The second family
    won every Qwen3-8B TP=2 shape in the sweep (`bench/kernels.py --gemm`, bench/NOTES.md) by 5-28%
    over the heuristic, which still wins the small 0.6B shapes; the right split varies per shape."""
    base = choose_config(M, N, K, num_sms, dtype)
    block_n = max(base.block_n, min(32, max(16, triton.next_power_of_2(N))))
    block_k = _block_k(_ROW_BYTES_PER_STEP // 2, K, dtype)
    tiles, k_steps = triton.cdiv(N, block_n), triton.cdiv(K, block_k)
    split = _fill_split(tiles, k_steps, num_sms)
    configs = [base]
    for s in (split, 2 * split):
        config = _config(block_n, block_k, s, k_steps)
        if not _has_empty_split(s, k_steps) and config not in configs:
            configs.append(config)
    return configs


# ----- kernel -----


@triton.jit
def _store_output(acc, s_ptr, b_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om, HAS_SCALE: tl.constexpr,
                  HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """acc (* the weight rows' scales) (+ bias) (+ the residual, which out holds), in fp32, rounded once. Each
    element of out is read and written by the same program only, so the residual can be updated in place."""
    if HAS_SCALE:
        acc = acc * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if HAS_RESIDUAL:
        acc = acc + tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def converts_fp8_bitwise(device: torch.device) -> bool:
    """Whether bf16 products of fp8 weights convert them with `e4m3_to_bf16`: its bf16x2 multiply needs sm_90+
    (Ada's fp8 weights take Triton's conversion), and the CPU interpreter runs no inline PTX."""
    return device.type == "cuda" and not INTERPRETER and torch.cuda.get_device_capability(device) >= (9, 0)


@triton.jit
def e4m3_to_bf16(w):
    """float8_e4m3fn -> bfloat16, exactly (NaN excepted: quantized weights are finite), four values per 32-bit
    register with integer ops and one bf16x2 multiply: each byte's exponent and mantissa shifted into bfloat16's
    fields, its sign kept, then times 2^120 (the exponent biases 127 - 7). Triton's own conversion goes through
    float16 and spends a quarter-rate F2F on every value, which bounds fp8 matmuls by conversions (bench/NOTES.md,
    2026-11-29). sm_90+ (`mul.rn.bf16x2`); not for the CPU interpreter."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b32 s, a, b, t, u, c;
        and.b32 s, $2, 0x7F7F7F7F;
        prmt.b32 a, $2, 0, 0x1404;
        prmt.b32 b, $2, 0, 0x3424;
        prmt.b32 t, s, 0, 0x1404;
        prmt.b32 u, s, 0, 0x3424;
        shr.b32 t, t, 4;
        shr.b32 u, u, 4;
        lop3.b32 a, a, t, 0x80008000, 0xE4;
        lop3.b32 b, b, u, 0x80008000, 0xE4;
        mov.b32 c, 0x7B807B80;
        mul.rn.bf16x2 $0, a, c;
        mul.rn.bf16x2 $1, b, c;
        }
        """,
        "=r,=r,r", [w.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,  # [N] float32 scales of fp8 weight rows (unused without HAS_SCALE)
    b_ptr,
    out_ptr,  # [M, N]: with HAS_RESIDUAL, holds the residual on entry
    partial_ptr,  # [SPLIT_K, M, N] fp32 (unused when SPLIT_K == 1)
    counter_ptr,  # [>= cdiv(N, BLOCK_N)] int32, all zero between launches
    M,
    N,
    K,
    K_PER_SPLIT,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # dot in fp32: only for the CPU interpreter, whose bf16 dot is wrong
    BITWISE_FP8: tl.constexpr,  # fp8 weights to bf16 by `e4m3_to_bf16` (bf16 x on sm_90+)
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(K, k_start + K_PER_SPLIT)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k_start + offs_k)[None, :] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # x comes from the previous kernel
    for k in range(k_start, k_end, BLOCK_K):
        mask_k = offs_k < K - k  # split ranges are whole steps: only the last step of K is partial
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        elif BITWISE_FP8:
            w = e4m3_to_bf16(w)
        elif HAS_SCALE:  # fp8 weights: multiplied in x's dtype
            w = w.to(x.dtype)
        # "ieee" keeps fp32 inputs exact (no TF32); it is ignored for 16-bit inputs.
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if USE_PDL:
        # The next kernel may launch while we store and reduce. Not earlier: with several waves
        # of programs its waiting ones would take SM slots from our later waves (bench/NOTES.md).
        tl.extra.cuda.gdc_launch_dependents()
    if SPLIT_K == 1:
        _store_output(acc, s_ptr, b_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om, HAS_SCALE, HAS_BIAS,
                      HAS_RESIDUAL)
    else:
        mask_mn = mask_m[:, None] & mask_n[None, :]
        tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(partial_ptr + pid_k * M * N + tile, acc, mask=mask_mn)
        # Every thread's partial is stored before the (one-thread, acq_rel, GPU-scope) arrival.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_n, 1)
        if arrived == SPLIT_K - 1:
            # Last to arrive: sum all splits in split order (bitwise the same whoever is last).
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            split_ids = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32) + pid_k  # (a block mask: the CPU interpreter
            for s in tl.static_range(SPLIT_K):                                # mis-types block & scalar masks)
                mine = split_ids == s
                other = tl.load(partial_ptr + s * M * N + tile, mask=mask_mn & (split_ids != s), other=0.0,
                                cache_modifier=".cg")
                total += tl.where(mine, acc, other)
            tl.store(counter_ptr + pid_n, 0)
            _store_output(total, s_ptr, b_ptr, out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om, HAS_SCALE,
                          HAS_BIAS, HAS_RESIDUAL)


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  weight_scale: torch.Tensor | None) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    M, K = x.shape
    if not 1 <= M <= MAX_M:
        raise ValueError(f"skinny_linear takes 1 <= M <= {MAX_M} rows, got M={M}")
    if weight.shape[1] != K:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x {tuple(x.shape)}: need [N, {K}]")
    if weight.shape[0] < 1 or K < 1:
        raise ValueError(f"empty matmul: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"dtype {x.dtype} not supported; use one of {_SUPPORTED_DTYPES}")
    if weight_scale is None and weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    if weight_scale is not None:
        if weight.dtype != FP8_DTYPE:
            raise ValueError(f"a weight with weight_scale must be {FP8_DTYPE}, got {weight.dtype}")
        if weight_scale.shape != (weight.shape[0],) or weight_scale.dtype != torch.float32:
            raise ValueError(f"weight_scale must be float32 of shape ({weight.shape[0]},), got "
                             f"{weight_scale.dtype} {tuple(weight_scale.shape)}")
        if weight_scale.device != x.device:
            raise ValueError(f"weight_scale is on {weight_scale.device}, x on {x.device}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    for name, t in (("x", x), ("weight", weight)):
        if sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) >= 2**31:
            raise ValueError(f"{name} spans 2**31 elements or more (the kernel uses int32 offsets)")
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise ValueError(f"bias dtype {bias.dtype} differs from x dtype {x.dtype}")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device}, x on {x.device}")


def _check_residual(residual: torch.Tensor, x: torch.Tensor, N: int) -> None:
    """The residual is the kernel's output: [M, N] in x's dtype with unit column stride (any row stride)."""
    if residual.shape != (x.shape[0], N):
        raise ValueError(f"residual must have shape ({x.shape[0]}, {N}), got {tuple(residual.shape)}")
    if residual.dtype != x.dtype:
        raise ValueError(f"residual dtype {residual.dtype} differs from x dtype {x.dtype}")
    if residual.device != x.device:
        raise ValueError(f"residual is on {residual.device}, x on {x.device}")
    if residual.stride(1) != 1:
        raise ValueError(f"residual needs unit stride along N (it is updated in place), got strides {residual.stride()}")
    if (residual.shape[0] - 1) * residual.stride(0) + N - 1 >= 2**31:
        raise ValueError("residual spans 2**31 elements or more (the kernel uses int32 offsets)")


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    residual: torch.Tensor | None = None, config: SkinnyConfig | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (any strides) @ weight[N, K]^T (+ bias[N]) -> [M, N] in x's dtype, fp32 accumulation.
    With `residual` [M, N]: residual + x @ weight^T (+ bias), summed in fp32 and rounded once, written
    into `residual` in place and returned. With `weight_scale` [N] (a float8_e4m3fn weight): the weight
    is weight * weight_scale[:, None]."""
    _check_inputs(x, weight, bias, weight_scale)
    M, K = x.shape
    N = weight.shape[0]
    if residual is not None:
        _check_residual(residual, x, N)
    if config is None:
        config = choose_config(M, N, K, num_sms(x.device), weight.dtype)
    elif config.block_m < M or config.split_k < 1:
        raise ValueError(f"config {config} cannot cover M={M}")
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    out = residual if residual is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    pdl = pdl_enabled(x.device)
    grid = config.grid(N)
    if config.split_k > 1:
        partial = torch.empty((config.split_k, M, N), dtype=torch.float32, device=x.device)
        counters = arrival_counters(x.device, grid[0])
    else:
        partial = counters = out  # unused
    _skinny_gemm_kernel[grid](
        x, weight, weight_scale if weight_scale is not None else out, bias if bias is not None else out, out,
        partial, counters,
        M, N, K, config.k_per_split(K),
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
        HAS_SCALE=weight_scale is not None,
        HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None,
        SPLIT_K=config.split_k,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        UPCAST=x.dtype == torch.bfloat16 and INTERPRETER,
        BITWISE_FP8=weight_scale is not None and x.dtype == torch.bfloat16 and converts_fp8_bitwise(x.device),
        USE_PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        launch_pdl=pdl,
    )
    return out


# ----- start-up tuning -----


def graph_seconds_per_call(calls: list[Callable[[], object]], replays: int = 5) -> float:
    """Median time per call over replays of one CUDA graph holding all `calls` (eager warm-up
    first, which also compiles and allocates what capture may not). Graphs leave out launch
    overhead, as in a decode step; bench/kernels.py times its kernels the same way."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del graph
    return statistics.median(times) / len(calls)


def linear_weights(model: torch.nn.Module) -> dict[tuple[int, int, torch.dtype], list[tuple[torch.Tensor, ...]]]:
    """(N, K, weight dtype) -> [(weight, bias the layer passes, weight_scale)] of every linear layer routed through
    `linear`: the projections and the MoE routers."""
    from nanoinfer.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
    from nanoinfer.layers.moe import Router

    groups: dict = {}
    for module in model.modules():
        if isinstance(module, Router):
            bias, weight_scale = None, None
        elif isinstance(module, LinearBase):
            bias, weight_scale = module.bias, module.weight_scale
            # Column-parallel biases are added after the deferred norm's scale (`DeferredNorm`), not by the matmul.
            if isinstance(module, ColumnParallelLinear) or (isinstance(module, RowParallelLinear) and module.tp_rank != 0):
                bias = None
        else:
            continue
        weight = module.weight
        groups.setdefault((weight.shape[0], weight.shape[1], weight.dtype), []).append((weight, bias, weight_scale))
    return groups


# ||skinny - reference|| / ||reference|| a correct kernel stays well inside (both accumulate in float32).
_TUNE_REL_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _activation_dtype(model: torch.nn.Module, weight_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype of x for weights of `weight_dtype`: theirs, or for fp8 weights the model's (its first 16- or
    32-bit float parameter); None where there is none the kernel takes."""
    if weight_dtype in _SUPPORTED_DTYPES:
        return weight_dtype
    if weight_dtype != FP8_DTYPE:
        return None
    return next((p.dtype for p in model.parameters() if p.dtype in _SUPPORTED_DTYPES), None)


@torch.inference_mode()
def tune_skinny_gemm(model: torch.nn.Module, buckets: Iterable[int], *, min_calls: int = 64) -> dict:
    """Time `dense_linear` (cuBLAS: `F.linear`, or for fp8 weights `fp8_matmul`) against `skinny_linear`
    at each of `candidate_configs` once per (M bucket <= 16, N, K, weight dtype) of the model's linear
    layers and record the fastest for `linear` (a config, or None for cuBLAS).

    Each timing replays a CUDA graph of >= `min_calls` calls that rotate over every layer's own
    weight of that shape (28 distinct matrices for Qwen3-0.6B), so the weights stream from HBM
    as in a decode step rather than sitting in L2; graphs also hide launch overhead. Both sides
    run on the same random x; each config is first checked against the product in float32 of x and the
    weight as the layer means it (an fp8 weight times its scales). Under tensor parallelism every rank records
    rank 0's choices. Set NANOINFER_SKINNY_GEMM=0 to skip (everything stays cuBLAS). Returns this rank's
    {(M, N, K, weight dtype): (cublas_us, best_us, best config or None)}."""
    start = time.perf_counter()
    results = {} if os.environ.get("NANOINFER_SKINNY_GEMM", "1") == "0" else _time_linears(model, buckets, min_calls)
    # Each rank times its own GPU, but all run rank 0's choices (every rank gets here once, whatever it timed): a
    # replicated layer (the MoE router) must give every rank the same output bits, or ranks would route a token to
    # different experts.
    chosen = tp_rank0_object({key: best for key, (_, _, best) in results.items()})
    skinny_dispatch._choices.update(chosen)
    if results:
        summary = ", ".join(f"{m}x{n}x{k} {cublas:.1f}/{best:.1f}{'*' if chosen.get((m, n, k, dtype)) else ''}"
                            for (m, n, k, dtype), (cublas, best, _) in results.items())
        logger.info("skinny GEMM tuned in %.1f s (MxNxK this rank's cuBLAS/best us, * = skinny chosen): %s",
                    time.perf_counter() - start, summary)
    return results


def _time_linears(model: torch.nn.Module, buckets: Iterable[int], min_calls: int) -> dict:
    """`tune_skinny_gemm`'s timings on this rank's GPU: {(M, N, K, weight dtype): (cublas_us, best_us, best config
    or None)}, empty where there is nothing to tune (no linear layers, or not on CUDA)."""
    groups = linear_weights(model)
    if not groups:
        return {}
    device = next(iter(groups.values()))[0][0].device
    if not skinny_dispatch._kernel_device(next(iter(groups.values()))[0][0]):
        return {}
    ms = sorted({skinny_dispatch.m_bucket(b) for b in buckets if 1 <= b <= MAX_M})
    results = {}
    for (N, K, weight_dtype), layers in groups.items():
        dtype = _activation_dtype(model, weight_dtype)
        if dtype is None:
            continue
        rounds = math.ceil(min_calls / len(layers))
        for M in ms:
            x = torch.randn(M, K, device=device, dtype=dtype)
            w, b, s = layers[0]
            expected = F.linear(x.float(), dequantized(w, s, torch.float32), None if b is None else b.float())
            dense = [functools.partial(skinny_dispatch.dense_linear, x, w, b, weight_scale=s) for w, b, s in layers]
            best, t_best = None, graph_seconds_per_call(dense * rounds)
            t_dense = t_best
            for config in candidate_configs(M, N, K, num_sms(device), weight_dtype):
                out = skinny_linear(x, w, b, config=config, weight_scale=s).float()
                error = ((out - expected).norm() / expected.norm().clamp_min(1e-30)).item()
                if not error <= _TUNE_REL_TOL[dtype]:  # a kernel that is wrong on this GPU never wins
                    logger.error("skinny GEMM %dx%dx%d %s %s: relative error %.2g vs the float32 product; not used",
                                 M, N, K, weight_dtype, config, error)
                    continue
                t = graph_seconds_per_call([functools.partial(skinny_linear, x, w, b, config=config, weight_scale=s)
                                            for w, b, s in layers] * rounds)
                if t < t_best:
                    best, t_best = config, t
            results[(M, N, K, weight_dtype)] = (t_dense * 1e6, t_best * 1e6, best)
    return results
