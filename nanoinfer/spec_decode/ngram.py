"""Speculative decoding by n-gram lookup (vLLM's `speculative_config={"method": "ngram", ...}`), the
control-plane half: proposing draft tokens.

A request whose newest tokens repeat an earlier stretch of its prompt or output (code being edited, a document
being quoted, a list continuing its pattern) will often go on as it did then. The proposer finds the longest
suffix of the request's tokens, between `prompt_lookup_min` and `prompt_lookup_max` tokens, that occurred
before, and proposes the tokens that followed its latest earlier occurrence. The next step computes the request's
newest token and the drafts in one forward pass (they are just more query tokens of the request) and samples
every position; the model runner keeps the drafts up to the first one that differs from what was sampled, plus
that sample. A step thus yields 1 to num_speculative_tokens + 1 tokens for the price of one pass over the weights
and the KV cache, and the output is the one decoding without drafts gives: each kept token is what the request's
own sampler drew at its position."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    method: str = "ngram"
    # No drafts are proposed while more requests than this are running or waiting: a large batch is bound by its
    # bytes and its host work, which drafts only add to.
    disable_by_batch_size: int | None = None

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> "SpeculativeConfig":
        """vLLM's dict form; as there, a missing lookup bound takes the other's value, and both default to 5."""
        if not isinstance(config, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(config).__name__}")
        unknown = sorted(set(config) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; valid keys: {list(_KEYS)}")
        method = config.get("method", "ngram")
        if method != "ngram":
            raise ValueError(f"speculative_config: method {method!r} is not supported; only 'ngram' is (drafts by "
                             "prompt lookup: no draft model)")
        k = config.get("num_speculative_tokens")
        if k is None:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = 5
        low, high = (high if low is None else low), (low if high is None else high)
        for name, value in (("num_speculative_tokens", k), ("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
                raise ValueError(f"speculative_config: {name} must be an integer in [1, 64], got {value!r}")
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min ({low}) is larger than prompt_lookup_max ({high})")
        limit = config.get("disable_by_batch_size")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be a positive integer or None, got "
                             f"{limit!r}")
        return cls(k, high, low, disable_by_batch_size=limit)


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_drafts) tokens that followed the latest earlier occurrence of
        the longest matching suffix of `token_ids`, or none."""
        k = min(self.config.num_speculative_tokens, max_drafts)
        n_max = min(self.config.prompt_lookup_max, len(token_ids) - 1)
        if k <= 0 or n_max < self.config.prompt_lookup_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # length[e]: how many tokens ending at position e (before the newest token) equal the suffix of that
        # length, grown one position back per pass: n_max vector passes, whatever the repetitions.
        earlier = tokens[:-1]
        match = earlier == tokens[-1]
        length = match.astype(np.int32)
        for back in range(1, n_max):
            match[back:] &= earlier[:-back] == tokens[-1 - back]
            match[:back] = False
            length += match
        best = int(length.max(initial=0))
        if best < self.config.prompt_lookup_min:
            return []
        end = len(earlier) - 1 - int(np.argmax(length[::-1] == best))  # the latest occurrence
        return tokens[end + 1 : end + 1 + k].tolist()
