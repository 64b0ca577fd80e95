"""Attention backend on our Triton kernels: `rotate_and_cache` applies the
deferred input norm, normalises and rotates the step's queries and keys and
scatters new K/V rows into the paged cache in one kernel, `forward` runs paged
attention with a launch shape picked from the metadata's host ints, so a decode
step never syncs the device and can be captured in a CUDA graph."""

from __future__ import annotations

import torch

from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.kernels import num_sms
from nanoinfer.kernels.attention_config import PagedAttentionConfig, choose_config
from nanoinfer.kernels.paged_attention import paged_attention
from nanoinfer.kernels.rotate_and_cache import rotate_and_cache
from nanoinfer.layers.layernorm import DeferredNorm, RMSNorm
from nanoinfer.layers.rotary import RotaryEmbedding


class TritonAttentionBackend:
    name = "triton"

    def rotate_and_cache(self, qkv, positions, rope: RotaryEmbedding, q_norm: RMSNorm | None,
                         k_norm: RMSNorm | None, k_cache, v_cache, slot_mapping, num_heads: int,
                         input_norm: DeferredNorm) -> torch.Tensor:
        if (q_norm is None) != (k_norm is None) or (q_norm is not None and q_norm.eps != k_norm.eps):
            raise ValueError("q_norm and k_norm must both be given, with the same eps, or neither")
        return rotate_and_cache(qkv, positions, rope.cos_cache, rope.sin_cache,
                                None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
                                0.0 if q_norm is None else q_norm.eps, k_cache, v_cache, slot_mapping, num_heads,
                                input_norm.hidden, input_norm.eps, input_norm.bias)

    def launch_config(self, query, k_cache, metadata: AttentionMetadata) -> PagedAttentionConfig:
        """The kernel's tiles and split count for this batch, from host ints only."""
        return choose_config(
            num_heads=query.shape[1],
            num_kv_heads=k_cache.shape[2],
            dtype=query.dtype,
            max_query_len=metadata.max_query_len,
            num_seqs=metadata.num_seqs,
            max_seq_len=metadata.max_seq_len,
            num_sms=num_sms(query.device),  # steers decode splitting
            cache_dtype=k_cache.dtype,
        )

    def forward(self, query, k_cache, v_cache, metadata: AttentionMetadata, scale: float,
                config: PagedAttentionConfig | None = None) -> torch.Tensor:
        """`config` replaces `launch_config`'s choice (the kernel tests pin tiles and splits)."""
        config = config or self.launch_config(query, k_cache, metadata)
        return paged_attention(
            query,
            k_cache,
            v_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            scale,
            max_query_len=metadata.max_query_len,
            config=config,
            seq_order=metadata.seq_order if config.decode else None,
        )
