"""Vocabulary-parallel token embedding and LM head: each rank owns a contiguous
slice of the vocabulary rows (the last slice zero-padded when the vocabulary
does not divide evenly)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.distributed.parallel_state import tp_all_reduce, tp_gather_last_dim_to_rank0, tp_rank, tp_world_size
from nanoinfer.layers.linear import copy_weight


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_world_size()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
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
        # Tokens outside this rank's slice look up row 0 and are zeroed; the all-reduce fills them in.
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        out = F.embedding((input_ids - self.vocab_start) * mask, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states onto this rank's vocabulary slice, then gathers the full vocabulary
    on rank 0, the rank that samples (others get None). Its weight may be the embedding's (tied
    embeddings): same shape and sharding."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = tp_gather_last_dim_to_rank0(F.linear(hidden_states, self.weight))
        return None if logits is None else logits[..., : self.num_embeddings]
