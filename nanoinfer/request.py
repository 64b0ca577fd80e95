"""One request as the engine core sees it: tokens and how many are computed.

There is no prefill or decode state. A request needs `num_tokens -
num_computed_tokens` more tokens computed; once that is one and it gets a new
token it is "decoding" only in the sense that the gap is one again."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future

from nanoinfer.kv_cache.hashing import extend_block_hashes, first_block_key
from nanoinfer.lora.request import LoRARequest
from nanoinfer.outputs import TokenLogprobs
from nanoinfer.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # this request failed (its sampling or detokenization raised); others go on

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                   RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: set[int],
        block_size: int,
        max_tokens: int,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # resolved: params.max_tokens or what max_model_len leaves
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Token ids that end the request (eos unless ignore_eos, plus stop_token_ids).
        self.stop_token_ids = set(sampling_params.stop_token_ids or ())
        if not sampling_params.ignore_eos:
            self.stop_token_ids |= eos_token_ids
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Tokens scheduled for sampling whose value has not come back yet (async scheduling).
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit length at first scheduling
        self.num_preemptions = 0
        self.block_size = block_size
        self.block_hashes: list[int] = []
        self.first_block_key = first_block_key(cache_salt, self.lora_int_id)  # its cache is its tenant's and adapter's
        extend_block_hashes(self.block_hashes, self.all_token_ids, block_size, self.first_block_key)
        # The prompt's logprobs as the runner computes them, chunk by chunk (position 0 has none); they leave with
        # the request's first output. A recompute after preemption writes the same values again.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            None if sampling_params.prompt_logprobs is None else [None] * len(prompt_token_ids))
        # Structured outputs: the grammar compiling in the engine core's grammar thread; the scheduler admits the
        # request once it is done.
        self.grammar: Future | None = None
        # Speculative decoding: the draft tokens its next step checks. Penalties, grammars and bad words of several
        # tokens make a position's distribution depend on the tokens before it on the host, so those get none.
        self.spec_token_ids: list[int] = []
        p = sampling_params
        self.can_speculate = (not p.uses_penalties and p.structured_outputs is None
                              and all(len(w) == 1 for w in p.bad_words_token_ids or ()))

    def take_prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        """The prompt's logprobs, once (for the request's first output); None after, or if not asked for."""
        logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        return logprobs

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Prompt logprobs need every prompt position computed, so such a request reads no cached block."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id; 0: the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int, max_model_len: int) -> bool:
        """Append one sampled token; if it ends the request, set a finished status and return True (stop strings
        are the detokenizer's job). Runs once per token of every request, so it keeps to plain attribute work."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        num_tokens, num_output = len(self.all_token_ids), len(self.output_token_ids)
        if num_tokens % self.block_size == 0:  # it completes a block: hash it for the prefix cache
            extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size, self.first_block_key)
        if token_id in self.stop_token_ids and num_output >= self.sampling_params.min_tokens:
            self.status = RequestStatus.FINISHED_STOPPED
            # As in vLLM: a stop_token_ids hit is reported, an end-of-sequence token is not.
            self.stop_reason = token_id if token_id in (self.sampling_params.stop_token_ids or ()) else None
        elif num_output >= self.max_tokens or num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
        else:
            return False
        return True
