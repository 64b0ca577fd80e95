"""Attention backend on our Triton kernels: `write_kv` scatters new K/V rows
into the paged cache, `forward` runs paged attention with a launch shape picked
from the metadata's host ints, so a decode step never syncs the device and
can be captured in a CUDA graph."""

from __future__ import annotations

import functools

import torch

from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.kernels.kv_write import write_kv
from nanoinfer.kernels.paged_attention import PagedAttentionConfig, choose_config, paged_attention


@functools.cache
def _num_sms(device: torch.device) -> int:
    """SM count steers decode splitting; the CPU interpreter has no SMs to fill."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


class TritonAttentionBackend:
    name = "triton"

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def launch_config(self, query, k_cache, metadata: AttentionMetadata) -> PagedAttentionConfig:
        """The kernel's tiles and split count for this batch, from host ints only."""
        return choose_config(
            num_heads=query.shape[1],
            num_kv_heads=k_cache.shape[2],
            dtype=query.dtype,
            max_query_len=metadata.max_query_len,
            num_seqs=metadata.num_seqs,
            max_seq_len=metadata.max_seq_len,
            num_sms=_num_sms(query.device),
        )

    def forward(self, query, k_cache, v_cache, metadata: AttentionMetadata, scale: float,
                config: PagedAttentionConfig | None = None) -> torch.Tensor:
        """`config` replaces `launch_config`'s choice (the kernel tests pin tiles and splits)."""
        return paged_attention(
            query,
            k_cache,
            v_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            scale,
            max_query_len=metadata.max_query_len,
            config=config or self.launch_config(query, k_cache, metadata),
        )
