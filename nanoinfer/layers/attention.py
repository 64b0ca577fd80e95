"""The attention layer models call. It owns no weights: from the fused QKV
projection it has the backend normalise and rotate queries and keys and write
this step's K/V into its slice of the paged cache, then attend over it."""

from __future__ import annotations

import os

import torch
from torch import nn

from nanoinfer.attention.backend import AttentionBackend
from nanoinfer.attention.metadata import get_forward_context
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Bound by the model runner once the KV cache exists (`bind_kv_cache`).
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor, rope: RotaryEmbedding,
                q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> torch.Tensor:
        """qkv: [T, (num_heads + 2 * num_kv_heads) * head_dim], not yet rotated -> [T, num_heads * head_dim].
        q_norm/k_norm: Qwen3's RMSNorm over each query and key head, applied before rotation."""
        if self.backend is None or self.k_cache is None:
            raise RuntimeError("Attention layer has no KV cache bound; call ModelRunner.bind_kv_cache first")
        out = self.backend.rotate_cache_and_attend(qkv, positions, rope, q_norm, k_norm, self.k_cache, self.v_cache,
                                                   get_forward_context(), self.num_heads, self.scale)
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
        layer.k_cache, layer.v_cache, layer.backend = k_cache_view(kv_cache[0, i]), v_cache_view(kv_cache[1, i]), backend
    return len(layers)


def head_major_kv() -> bool:
    """NANOINFER_HEAD_MAJOR_KV=1 (experimental, off until measured): K, and a V kept as K, head-major inside each
    block (`head_major_view`)."""
    return os.environ.get("NANOINFER_HEAD_MAJOR_KV") == "1"


def k_cache_view(cache: torch.Tensor) -> torch.Tensor:
    """A contiguous `[blocks, block_size, kv_heads, head_dim]` tensor as the engine keeps a K cache."""
    return head_major_view(cache) if head_major_kv() else cache


def v_cache_view(cache: torch.Tensor) -> torch.Tensor:
    """A contiguous `[blocks, block_size, kv_heads, head_dim]` tensor as the engine keeps a V cache:
    an fp8 one dim-major inside each block (`dim_major_view`), any other as K."""
    return dim_major_view(cache) if cache.dtype == torch.float8_e4m3fn else k_cache_view(cache)


def head_major_view(cache: torch.Tensor) -> torch.Tensor:
    """A contiguous `[blocks, block_size, kv_heads, head_dim]` cache's memory read as `[blocks, kv_heads,
    block_size, head_dim]` and viewed back in the `[block, slot, kv_head, dim]` order: one head's 16 rows of a
    block are adjacent (2 KB in fp8), where token-major they are 128-byte pieces 1 KB apart (Qwen3-0.6B, fp8):
    the decode kernel's K loads become a few long runs instead of many short ones. Same bytes, same block ids."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    return cache.view(num_blocks, num_kv_heads, block_size, head_dim).permute(0, 2, 1, 3)


def dim_major_view(cache: torch.Tensor) -> torch.Tensor:
    """A contiguous `[blocks, block_size, kv_heads, head_dim]` cache's memory read as `[blocks,
    kv_heads, head_dim, block_size]` and viewed back in the `[block, slot, kv_head, dim]` order:
    one head's tokens of one dim are adjacent. The Triton decode kernel's P x V dot runs along
    tokens, and for fp8 it then loads four at once instead of one byte at a time (13-18%
    faster fp8 decode attention on an H200, bench/RESULTS.md). Same bytes, same block ids."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    return cache.view(num_blocks, num_kv_heads, head_dim, block_size).permute(0, 3, 1, 2)
