"""Vocabulary-parallel token embedding and LM head: each rank owns a contiguous
slice of the vocabulary rows (the last slice zero-padded when the vocabulary
does not divide evenly)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.distributed.parallel_state import tp_gather_last_dim_to_rank0, tp_rank, tp_world_size
from nanoinfer.layers.fusion import fused
from nanoinfer.layers.linear import copy_weight, reduce_partial


@fused
def masked_embedding(input_ids: torch.Tensor, weight: torch.Tensor, vocab_start: int, vocab_end: int) -> torch.Tensor:
    """This rank's rows of the lookup: tokens outside [vocab_start, vocab_end) look up row 0 and
    are zeroed, so the sum over ranks is the full lookup."""
    mask = (input_ids >= vocab_start) & (input_ids < vocab_end)
    return F.embedding((input_ids - vocab_start) * mask, weight) * mask.unsqueeze(-1).to(weight.dtype)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, all_reduce_slot: int = 2) -> None:
        """all_reduce_slot: where the partial lookups are summed over TP ranks (`reduce_partial`)."""
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_world_size()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.all_reduce_slot = all_reduce_slot
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: None = None) -> None:
        if loaded_weight.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"shape mismatch: checkpoint {tuple(loaded_weight.shape)}, "
                f"expected {(self.num_embeddings, self.embedding_dim)}"
            )
        rows = self.vocab_end - self.vocab_start
        copy_weight(param.data[:rows], loaded_weight[self.vocab_start : self.vocab_end])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        partial = masked_embedding(input_ids, self.weight, self.vocab_start, self.vocab_end)
        return reduce_partial(partial, None, self.all_reduce_slot)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states onto this rank's vocabulary slice, then gathers the full vocabulary
    on rank 0, the rank that samples (others get None). Its weight may be the embedding's (tied
    embeddings): same shape and sharding."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = tp_gather_last_dim_to_rank0(F.linear(hidden_states, self.weight))
        return None if logits is None else logits[..., : self.num_embeddings]
