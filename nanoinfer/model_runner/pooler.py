"""runner="pooling": each prompt's final hidden states pooled into one float32 vector, on the device.

A prompt may be prefilled in several chunks (chunked prefill), so MEAN and CLS keep what earlier chunks gave
in the request's state (`CachedRequestState.pooled`); LAST needs only the chunk that ends the prompt. A request
preempted and recomputed starts over with a fresh state, so nothing is counted twice."""

from __future__ import annotations

import torch

from nanoinfer.model_runner.state import CachedRequestState


class Pooler:
    def __init__(self, pooling_type: str) -> None:
        self.pooling_type = pooling_type

    def __call__(self, hidden: torch.Tensor, states: list[CachedRequestState], query_start_loc: list[int],
                 finishing: list[int], last_rows: torch.Tensor) -> torch.Tensor | None:
        """The vectors [len(finishing), hidden] of the requests whose prompt this step ends (None if none does):
        `states[i]` had rows `query_start_loc[i]:query_start_loc[i + 1]` of `hidden`, starting at its
        `num_computed_tokens`; `finishing`: the indices of those that end; `last_rows`: their last rows, on the
        device. Called every step: MEAN and CLS keep what each chunk gives."""
        if self.pooling_type == "LAST":
            return hidden[last_rows].float() if finishing else None
        for i, state in enumerate(states):
            begin, end = query_start_loc[i], query_start_loc[i + 1]
            if self.pooling_type == "MEAN":
                chunk = hidden[begin:end].float().sum(dim=0)
                state.pooled = chunk if state.pooled is None else state.pooled + chunk
            elif state.num_computed_tokens == 0:  # CLS: the chunk that holds the prompt's first token
                state.pooled = hidden[begin].float()
        if not finishing:
            return None
        vectors = torch.stack([states[i].pooled for i in finishing])
        if self.pooling_type == "MEAN":
            vectors /= torch.tensor([[states[i].prompt_len] for i in finishing], dtype=vectors.dtype,
                                    device=vectors.device)
        return vectors
