"""The attention layer models call. It owns no weights: from the fused QKV
projection it has the backend finish the input norm (`DeferredNorm`), normalise
and rotate queries and keys and write this step's K/V into its slice of the
paged cache, then attend over it."""

from __future__ import annotations

import torch
from torch import nn

from nanoinfer.attention.backend import AttentionBackend
from nanoinfer.attention.metadata import get_forward_context
from nanoinfer.layers.layernorm import DeferredNorm, RMSNorm
from nanoinfer.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Bound by the model runner once the KV cache exists (`bind_kv_cache`).
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, input_norm: DeferredNorm, rope: RotaryEmbedding,
                q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> torch.Tensor:
        """qkv: [T, (num_heads + 2 * num_kv_heads) * head_dim], the projection of the residual stream before the
        input norm's scale and the bias (`input_norm` applies them), not yet rotated -> [T, num_heads * head_dim].
        q_norm/k_norm: Qwen3's RMSNorm over each query and key head, applied before rotation."""
        if self.backend is None or self.k_cache is None:
            raise RuntimeError("Attention layer has no KV cache bound; call ModelRunner.bind_kv_cache first")
        metadata = get_forward_context()
        q = self.backend.rotate_and_cache(qkv, positions, rope, q_norm, k_norm, self.k_cache, self.v_cache,
                                          metadata.slot_mapping, self.num_heads, input_norm)
        out = self.backend.forward(q, self.k_cache, self.v_cache, metadata, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)


def bind_kv_cache(model: nn.Module, kv_cache: torch.Tensor, backend: AttentionBackend) -> int:
    """Give each Attention layer, in model order, its K and V views of the one KV tensor
    `[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]`. Every view is indexed
    `[block, slot, kv_head, dim]`; an fp8 cache's V views are dim-major inside each block
    (`dim_major_view`). Returns the layer count."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if len(layers) != kv_cache.shape[1]:
        raise ValueError(f"KV cache has {kv_cache.shape[1]} layers, model has {len(layers)} attention layers")
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache, layer.backend = kv_cache[0, i], v_cache_view(kv_cache[1, i]), backend
    return len(layers)


def v_cache_view(cache: torch.Tensor) -> torch.Tensor:
    """A contiguous `[blocks, block_size, kv_heads, head_dim]` tensor as the engine keeps a V cache:
    an fp8 one dim-major inside each block (`dim_major_view`), any other as it is."""
    return dim_major_view(cache) if cache.dtype == torch.float8_e4m3fn else cache


def dim_major_view(cache: torch.Tensor) -> torch.Tensor:
    """A contiguous `[blocks, block_size, kv_heads, head_dim]` cache's memory read as `[blocks,
    kv_heads, head_dim, block_size]` and viewed back in the `[block, slot, kv_head, dim]` order:
    one head's tokens of one dim are adjacent. The Triton decode kernel's P x V dot runs along
    tokens, and for fp8 it then loads four at once instead of one byte at a time (13-18%
    faster fp8 decode attention on an H200, bench/RESULTS.md). Same bytes, same block ids."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    return cache.view(num_blocks, num_kv_heads, head_dim, block_size).permute(0, 3, 1, 2)
