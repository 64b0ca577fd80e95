"""Reference attention in plain PyTorch: gathers each sequence's context from
the paged cache and calls `scaled_dot_product_attention`. Correct on any device
and shape; the Triton backend is checked against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.layers.layernorm import DeferredNorm, RMSNorm
from nanoinfer.layers.rotary import RotaryEmbedding


class TorchAttentionBackend:
    name = "torch"

    def rotate_and_cache(self, qkv, positions, rope: RotaryEmbedding, q_norm: RMSNorm | None,
                         k_norm: RMSNorm | None, k_cache, v_cache, slot_mapping, num_heads: int,
                         input_norm: DeferredNorm) -> torch.Tensor:
        qkv = input_norm.apply(qkv)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        if q_norm is not None:
            q, k = rope.forward_with_qk_norm(positions, q, k, q_norm, k_norm)
        else:
            q, k = rope(positions, q, k)
        self.write_kv(k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim), k_cache, v_cache,
                      slot_mapping)
        return q.view(-1, num_heads, head_dim)

    @staticmethod
    def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
        """Store key/value row t at cache slot `slot_mapping[t]` (-1: skip)."""
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
        block_size = k_cache.shape[1]
        blocks, slots = slot_mapping // block_size, slot_mapping % block_size  # any layout (fp8 V is dim-major)
        k_cache[blocks, slots] = to_cache_dtype(key, k_cache.dtype)
        v_cache[blocks, slots] = to_cache_dtype(value, v_cache.dtype)

    def forward(self, query, k_cache, v_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        if metadata.is_decode_only:
            return self._decode(query, k_cache, v_cache, metadata, scale)
        out = torch.empty_like(query)
        block_size = k_cache.shape[1]
        num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
        starts = metadata.query_start_loc_cpu
        for i, seq_len in enumerate(metadata.seq_lens_cpu):
            q = query[starts[i] : starts[i + 1]]  # [q_len, H, D]
            q_len = q.shape[0]
            if q_len == 0:
                continue
            num_blocks = (seq_len + block_size - 1) // block_size
            blocks = metadata.block_tables[i, :num_blocks].long()
            k = k_cache[blocks].flatten(0, 1)[:seq_len]  # [seq_len, Hkv, D]
            v = v_cache[blocks].flatten(0, 1)[:seq_len]
            # Query j sits at position seq_len - q_len + j and sees keys up to it.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1),
                k.transpose(0, 1).to(q.dtype),
                v.transpose(0, 1).to(q.dtype),
                attn_mask=mask,
                scale=scale,
                enable_gqa=num_heads != num_kv_heads,
            )
            out[starts[i] : starts[i + 1]] = o.transpose(0, 1)
        return out

    @staticmethod
    def _decode(query, k_cache, v_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """One query per sequence: gather every context into one padded batch and make a
        single attention call (a Python loop per sequence dominates CPU decode otherwise)."""
        block_size = k_cache.shape[1]
        max_len = metadata.max_seq_len
        num_seqs = metadata.num_seqs
        blocks = metadata.block_tables[:num_seqs, : (max_len + block_size - 1) // block_size].long()
        k = k_cache[blocks].flatten(1, 2)[:, :max_len]  # [B, L, Hkv, D]
        v = v_cache[blocks].flatten(1, 2)[:, :max_len]
        mask = torch.arange(max_len, device=query.device)[None, :] < metadata.seq_lens[:num_seqs, None]  # [B, L]
        # Slots past a sequence's end hold stale (even non-finite) values: 0 x NaN would leak through.
        k = k.to(query.dtype).masked_fill(~mask[:, :, None, None], 0)
        v = v.to(query.dtype).masked_fill(~mask[:, :, None, None], 0)
        out = torch.empty_like(query)  # rows past the last sequence (padding) stay unwritten
        out[:num_seqs] = F.scaled_dot_product_attention(
            query[:num_seqs, :, None, :],  # [B, H, 1, D]
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=query.shape[1] != k_cache.shape[2],
        )[:, :, 0, :]
        return out


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """K/V as the cache stores them: an fp8 cache saturates at its largest finite value and stores NaN
    as 0 (the Triton kernel does the same), so it holds only finite values: the Triton decode kernel
    reads a dim-major V in whole blocks, and a stale NaN past the context would survive its 0 weight."""
    if cache_dtype == torch.float8_e4m3fn:
        limit = torch.finfo(cache_dtype).max
        x = torch.nan_to_num(x, nan=0.0).clamp(-limit, limit)
    return x.to(cache_dtype)
