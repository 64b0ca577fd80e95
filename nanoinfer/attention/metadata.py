"""What one forward pass tells every attention layer about the batch.

The model runner fills one `AttentionMetadata` per step and installs it with
`set_forward_context`; each `Attention` layer reads it with
`get_forward_context`. Tokens of all sequences are flattened into one batch:
sequence `i` owns query rows `query_start_loc[i] : query_start_loc[i+1]`, and
after this step its context holds `seq_lens[i]` tokens, so its queries sit at
positions `seq_lens[i] - query_len_i ... seq_lens[i] - 1` (causal mask).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset; -1 = padding, not written
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    max_query_len: int
    max_seq_len: int
    # Host copies: the reference backend loops over sequences with them, and
    # the Triton backend picks a launch configuration without a device sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Decode steps: [num_seqs] int32, the sequences longest first. The attention kernel starts their programs in
    # this order, so unequal contexts do not leave one long sequence running alone at the end of the launch.
    seq_order: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


_forward_context: AttentionMetadata | None = None


@contextmanager
def set_forward_context(metadata: AttentionMetadata | None) -> Iterator[None]:
    """Make `metadata` visible to attention layers for the duration of one forward."""
    global _forward_context
    previous, _forward_context = _forward_context, metadata
    try:
        yield
    finally:
        _forward_context = previous


def get_forward_context() -> AttentionMetadata:
    if _forward_context is None:
        raise RuntimeError("attention called outside set_forward_context(): the model runner must install step metadata")
    return _forward_context
