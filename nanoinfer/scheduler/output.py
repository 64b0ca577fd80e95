"""The control plane's message to the data plane, one per step.

The model runner keeps per-request state across steps, so a step sends a new
request's tokens once and afterwards only what changed (new block ids and the
computed-token count); this is also what goes over the wire to TP workers."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoinfer.lora.request import LoRARequest
from nanoinfer.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_len: int  # all_token_ids[:prompt_len] is the prompt (penalties need the split)
    all_token_ids: list[int]  # prompt plus outputs so far (non-empty outputs after a preemption)
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # Tokens to compute this step per request, in batch order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Requests finished, aborted or preempted since the last step: the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Speculative decoding: the draft tokens each request computes after its known ones (counted in
    # num_scheduled_tokens); the runner samples every one of their positions.
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens
