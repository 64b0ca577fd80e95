"""The attention backend interface: the only thing a kernel author implements.

A backend owns two operations over one layer's paged cache, whose K and V
halves are `[num_blocks, block_size, num_kv_heads, head_dim]` views into the
engine's single preallocated KV tensor:

* `rotate_and_cache` takes the fused QKV projection of the un-normalised
  residual stream, applies the layer's deferred input norm (`DeferredNorm`:
  its r and the projection's bias), the per-head norms (Qwen3) and rotary
  embedding, stores this step's K/V rows at their `slot_mapping` slots and
  returns the queries (one op, so a GPU backend can do it in one kernel);
* `forward` runs causal attention of the step's queries over each sequence's
  whole context, read through its block table.

The scheduler never sees a backend; the model runner picks one at start-up.
"""

from __future__ import annotations

from typing import Protocol

import torch

from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.layers.layernorm import DeferredNorm, RMSNorm
from nanoinfer.layers.rotary import RotaryEmbedding


class AttentionBackend(Protocol):
    name: str

    def rotate_and_cache(
        self,
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        positions: torch.Tensor,  # [num_tokens] int64
        rope: RotaryEmbedding,
        q_norm: RMSNorm | None,  # Qwen3's per-head norms (both or neither)
        k_norm: RMSNorm | None,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
        num_heads: int,
        input_norm: DeferredNorm,  # the layer's input RMSNorm, its weight folded into the projection
    ) -> torch.Tensor:  # queries [num_tokens, num_heads, head_dim]
        ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


def get_attention_backend(name: str) -> AttentionBackend:
    """`torch` (reference, any device) or `triton` (GPU, or CPU under TRITON_INTERPRET=1)."""
    if name == "torch":
        from nanoinfer.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from nanoinfer.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")
