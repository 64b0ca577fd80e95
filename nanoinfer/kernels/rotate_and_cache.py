"""Triton kernel for everything between the QKV projection and attention, in one launch:
apply the layer's deferred input norm (the projection reads the un-normalised residual
stream, the norm's weight folded into it: r from the token's residual row, then the
projection's bias, `DeferredNorm`), split the fused projection, RMS-normalise each query
and key head (Qwen3), rotate
queries and keys (RoPE, neox halves), return the queries and store this step's K/V
rows at their `slot_mapping` slots in the paged cache.

Done as separate ops this was five to six small kernels per layer (norms, rotary,
KV write), which at decode batch sizes cost far more in launches and poorly fused
index math than their few kilobytes of traffic. One program handles up to eight
consecutive heads of one token (query heads first, then KV heads, as the projection
lays them out) as one [heads, head_dim] tile, so all their loads are in flight at
once; a KV head also copies its V row. Each program reads its token's residual row for
the deferred norm's r (a token's row is read by about three programs: a few KB more). A slot of -1 marks a padding row (a CUDA-graph
batch padded to its bucket): its K/V are not stored, so the launch never needs the
host to look at slot_mapping.

Rounding follows the PyTorch path (`rms_scale_math`, `rms_norm_math`, `_rotate` in
layers/): the deferred norm's scale and bias in float32, rounded to the model dtype; norm
statistics in float32, normalised value rounded to the model dtype before the
weight multiply, rotation in float32, result rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoinfer.kernels import pdl_enabled
from nanoinfer.kernels.deferred_norm import bias_fits, block_hidden, hidden_fits, rms_scaled, row_rms_scale


@triton.jit
def _rotate_and_cache_kernel(
    qkv_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    hidden_ptr,
    qkv_bias_ptr,
    stride_qkv,
    stride_query,
    stride_rope,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vb,  # V's strides (an fp8 cache's V is dim-major inside each block)
    stride_vs,
    stride_vh,
    stride_vd,
    stride_hidden,
    n_hidden,
    eps,
    hidden_eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    CACHE_MAX: tl.constexpr,  # > 0: the cache's largest finite value (fp8), stores saturate to it
    HEADS: tl.constexpr,  # heads per program, as one [HEADS, HEAD_DIM] tile
    USE_PDL: tl.constexpr,
):
    """HEADS consecutive heads of one token (query heads, then KV heads): a query head's rotated row
    to `query`, a KV head's K and V rows to the cache."""
    token = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * HEADS
    head = first + tl.arange(0, HEADS)
    half = tl.arange(0, HEAD_DIM // 2)
    is_q = head < NUM_HEADS
    is_kv = (head >= NUM_HEADS) & (head < NUM_HEADS + NUM_KV_HEADS)
    position = tl.load(positions_ptr + token)
    cos = tl.load(cos_ptr + position * stride_rope + half)[None, :]
    sin = tl.load(sin_ptr + position * stride_rope + half)[None, :]
    # Before the wait, off the critical path: the residual row was written two kernels back (`pdl_enabled`).
    r = row_rms_scale(hidden_ptr + token * stride_hidden, n_hidden, hidden_eps, BLOCK_H)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # qkv comes from the previous kernel
        tl.extra.cuda.gdc_launch_dependents()
    qkv_row = qkv_ptr + token * stride_qkv
    col1 = head[:, None] * HEAD_DIM + half[None, :]  # first halves of q heads, then k heads, then v heads
    col2 = col1 + HEAD_DIM // 2
    rows = (is_q | is_kv)[:, None]
    dtype = qkv_ptr.dtype.element_ty
    x1 = rms_scaled(tl.load(qkv_row + col1, mask=rows, other=0.0), r, qkv_bias_ptr, col1, rows, dtype, HAS_BIAS)
    x2 = rms_scaled(tl.load(qkv_row + col2, mask=rows, other=0.0), r, qkv_bias_ptr, col2, rows, dtype, HAS_BIAS)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
        w1 = tl.where(is_q[:, None], tl.load(q_weight_ptr + half)[None, :], tl.load(k_weight_ptr + half)[None, :])
        w2 = tl.where(is_q[:, None], tl.load(q_weight_ptr + HEAD_DIM // 2 + half)[None, :],
                      tl.load(k_weight_ptr + HEAD_DIM // 2 + half)[None, :])
        x1 = ((x1 * rstd[:, None]).to(dtype).to(tl.float32) * w1.to(tl.float32)).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd[:, None]).to(dtype).to(tl.float32) * w2.to(tl.float32)).to(dtype).to(tl.float32)
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    if first < NUM_HEADS:
        dst = query_ptr + token * stride_query + head[:, None] * HEAD_DIM + half[None, :]
        tl.store(dst, out1.to(dtype), mask=is_q[:, None])
        tl.store(dst + HEAD_DIM // 2, out2.to(dtype), mask=is_q[:, None])
    if first + HEADS > NUM_HEADS:
        slot = tl.load(slot_mapping_ptr + token)
        kv = (tl.where(is_kv, slot, -1) >= 0)[:, None]  # a KV head of a real token (a block-only mask:
        # the CPU interpreter mis-types block & scalar masks)
        kv_head = head - NUM_HEADS
        offset = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        dst = k_cache_ptr + offset[:, None] + half[None, :]
        cache_dtype = k_cache_ptr.dtype.element_ty
        tl.store(dst, _cache_value(out1, dtype, cache_dtype, CACHE_MAX), mask=kv)
        tl.store(dst + HEAD_DIM // 2, _cache_value(out2, dtype, cache_dtype, CACHE_MAX), mask=kv)
        full = tl.arange(0, HEAD_DIM)
        v_col = (head[:, None] + NUM_KV_HEADS) * HEAD_DIM + full[None, :]  # the KV head's V row
        v = rms_scaled(tl.load(qkv_row + v_col, mask=kv), r, qkv_bias_ptr, v_col, kv, dtype, HAS_BIAS)
        v_offset = (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vs + kv_head * stride_vh
        tl.store(v_cache_ptr + v_offset[:, None] + full[None, :] * stride_vd,
                 _cache_value(v, dtype, cache_dtype, CACHE_MAX), mask=kv)


@triton.jit
def _cache_value(x, dtype: tl.constexpr, cache_dtype: tl.constexpr, CACHE_MAX: tl.constexpr):
    """Rounded to the model dtype (as the PyTorch path's K/V are), then to the cache's; an fp8 cache
    (CACHE_MAX > 0) saturates and stores NaN as 0, as the PyTorch path (`to_cache_dtype`) does."""
    x = x.to(dtype)
    if CACHE_MAX > 0:
        x = x.to(tl.float32)
        x = tl.where(x != x, 0.0, tl.clamp(x, -CACHE_MAX, CACHE_MAX))
    return x.to(cache_dtype)


# Launch shape, from a sweep of heads per program x warps against the sequential-heads kernel this replaced
# (bench/RESULTS.md, H200): 8 heads and 4 warps fastest from 1 to 1,024 tokens (256 tokens x 24 heads 3.5 -> 1.9 us),
# one warp past 1,024 (16,384 tokens x 24 heads 103 -> 76 us).
_HEADS_PER_PROGRAM = 8
_SMALL_LAUNCH_TOKENS = 1024


def choose_heads_per_program(total_heads: int) -> int:
    """Heads per program: 8, or the next power of two above a smaller head count (rows past it are masked)."""
    return min(_HEADS_PER_PROGRAM, triton.next_power_of_2(total_heads))


def rotate_and_cache(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_cache: torch.Tensor,  # [max_position, head_dim // 2] float32
    sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None,  # [head_dim], with k_norm_weight: Qwen3's per-head RMSNorm
    k_norm_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    num_heads: int,
    hidden: torch.Tensor,  # [num_tokens, hidden_size]: the residual stream rows qkv was projected from
    hidden_eps: float,  # with hidden: the deferred input norm's r = rsqrt(mean(hidden^2) + hidden_eps)
    qkv_bias: torch.Tensor | None = None,  # [(num_heads + 2 * num_kv_heads) * head_dim], added after r
    heads_per_program: int | None = None,  # a power of two; None: `choose_heads_per_program`
) -> torch.Tensor:
    """Returns the rotated queries [num_tokens, num_heads, head_dim]; stores K/V in the cache."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must be [num_blocks, block_size, num_kv_heads, head_dim] views of one dtype")
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] = "
                         f"[*, {(num_heads + 2 * num_kv_heads) * head_dim}] with unit last stride, got {tuple(qkv.shape)}")
    if head_dim % 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"positions and slot_mapping must be [{num_tokens}], got {tuple(positions.shape)} and {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    if cos_cache.shape != sin_cache.shape or cos_cache.shape[1] != head_dim // 2 or cos_cache.stride(1) != 1:
        raise ValueError(f"cos/sin tables must be [max_position, {head_dim // 2}], got {tuple(cos_cache.shape)}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both q and k norm weights or neither")
    if k_cache.stride(3) != 1:
        raise ValueError("the cache needs a contiguous last (head_dim) dimension")
    if not hidden_fits(qkv, hidden):
        raise ValueError(f"hidden must be [{num_tokens}, hidden_size] in qkv's dtype {qkv.dtype} "
                         f"with unit last stride, got {tuple(hidden.shape)} {hidden.dtype} stride {hidden.stride()}")
    if not bias_fits(qkv_bias, qkv.shape[1]):
        raise ValueError(f"qkv_bias must be None or a contiguous [{qkv.shape[1]}] float vector, got "
                         f"{tuple(qkv_bias.shape)} {qkv_bias.dtype}")
    query = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return query
    has_norm = q_norm_weight is not None
    pdl = pdl_enabled(qkv.device)
    heads_per_program = heads_per_program or choose_heads_per_program(num_heads + num_kv_heads)
    if heads_per_program < 1 or heads_per_program & (heads_per_program - 1):
        raise ValueError(f"heads_per_program must be a power of two (a tile's rows), got {heads_per_program}")
    _rotate_and_cache_kernel[(num_tokens, triton.cdiv(num_heads + num_kv_heads, heads_per_program))](
        qkv,
        positions,
        cos_cache,
        sin_cache,
        q_norm_weight if has_norm else cos_cache,  # unread without the norm
        k_norm_weight if has_norm else cos_cache,
        query,
        k_cache,
        v_cache,
        slot_mapping,
        hidden,
        qkv if qkv_bias is None else qkv_bias,  # unread without a bias
        qkv.stride(0),
        query.stride(0),
        cos_cache.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *v_cache.stride(),
        hidden.stride(0),
        hidden.shape[1],
        eps,
        hidden_eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        HAS_NORM=has_norm,
        HAS_BIAS=qkv_bias is not None,
        BLOCK_H=block_hidden(hidden),
        CACHE_MAX=torch.finfo(k_cache.dtype).max if k_cache.dtype == torch.float8_e4m3fn else 0.0,
        HEADS=heads_per_program,
        USE_PDL=pdl,
        num_warps=max(1, min(4, heads_per_program * head_dim // 256)) if num_tokens <= _SMALL_LAUNCH_TOKENS else 1,
        launch_pdl=pdl,
    )
    return query
