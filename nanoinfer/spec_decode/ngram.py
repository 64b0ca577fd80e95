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
    """Proposes each request's drafts after each of its steps. The search runs over a numpy copy of the request's
    tokens that only grows by its new ones (converting the whole list each step cost ~16 us of ~30 per request on
    our CPU at 1,000 tokens: ~8 ms per step at 256 requests)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (buffer, tokens in it)

    def forget(self, request_id: str) -> None:
        """The request is gone (finished or aborted): its buffer too, so a later request under its id starts anew."""
        self._tokens.pop(request_id, None)

    def propose(self, request_id: str, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_drafts) tokens that followed the latest earlier occurrence of
        the longest matching suffix of `token_ids` (the request's tokens so far: they only grow), or none."""
        k = min(self.config.num_speculative_tokens, max_drafts)
        n_max = min(self.config.prompt_lookup_max, len(token_ids) - 1)
        if k <= 0 or n_max < self.config.prompt_lookup_min:
            return []
        tokens = self._buffer(request_id, token_ids)
        # The positions before the newest token that hold a token equal to it, newest first; each is extended
        # backwards, all at once, while the tokens before it equal the suffix's: `length` is how far it matched.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        length = np.ones(len(ends), dtype=np.int64)
        alive = ends
        for back in range(1, n_max):
            alive = alive[(alive >= back) & (tokens[alive - back] == tokens[-1 - back])]
            if not len(alive):
                break
            length[np.searchsorted(ends, alive)] += 1
        if not len(ends) or int(length.max()) < self.config.prompt_lookup_min:
            return []
        end = int(ends[len(ends) - 1 - int(np.argmax(length[::-1] == length.max()))])  # the latest longest
        return tokens[end + 1 : end + 1 + k].tolist()

    def _buffer(self, request_id: str, token_ids: list[int]) -> np.ndarray:
        """The request's tokens as an int64 array, copying only what is new since the last call."""
        buffer, n = self._tokens.get(request_id, (None, 0))
        if buffer is None or n > len(token_ids):
            buffer, n = np.empty(max(64, 2 * len(token_ids)), dtype=np.int64), 0
        elif len(token_ids) > len(buffer):
            buffer = np.concatenate([buffer[:n], np.empty(len(token_ids) * 2 - n, dtype=np.int64)])
        buffer[n : len(token_ids)] = token_ids[n:]
        self._tokens[request_id] = (buffer, len(token_ids))
        return buffer[: len(token_ids)]
