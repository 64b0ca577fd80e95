"""What flows back up: the runner's sampled tokens, the core's per-request
deltas, and the user-facing results of `LLM.generate`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class TokenLogprobs:
    """One generated token's logprob, its rank in the distribution, and the top-n alternatives."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class Logprob:
    """A token's log probability as `LLM.generate` and the server give it (vLLM's type): its rank in the
    distribution (1: the most likely) and its text alone (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]  # requests that produced tokens this step (partial prefills did not)
    sampled_token_ids: list[list[int]]  # one token each, or with speculative decoding 1 + the drafts kept
    logprobs: list[list[TokenLogprobs | None]]  # per token
    # Requests whose sampling raised, with why: they end with finish_reason "error", the rest go on.
    errors: dict[str, str] = field(default_factory=dict)
    # Requests with prompt_logprobs whose prompt this step computed: (first position, its entries on).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # runner="pooling": the pooled vector of each request whose prompt this step finished (it ends with it).
    pooled: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # in the request's first output only
    pooled: list[float] | None = None  # runner="pooling": the prompt's pooled vector, in its only output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None  # per token: {token_id: Logprob} for the sampled + top-n
    finish_reason: str | None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None  # vLLM's: the sampled tokens' logprobs summed (with `logprobs` only)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One user request's state: its completions (one per child, `n`), whole or as deltas
    depending on the request's RequestOutputKind."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: per prompt position {token_id: Logprob} for the prompt's own token
    # and the top-n (None at position 0). A DELTA output carries them once, in the first output that has them.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def add(self, later: RequestOutput) -> None:
        """Fold a later DELTA output of this request into this one, so that a reader who fell
        behind gets one combined delta instead of a backlog."""
        mine = {c.index: c for c in self.outputs}
        for c in later.outputs:
            if c.index not in mine:
                mine[c.index] = c
                continue
            merged = mine[c.index]
            merged.text += c.text
            merged.token_ids = merged.token_ids + c.token_ids
            if c.logprobs is not None:
                merged.logprobs = (merged.logprobs or []) + c.logprobs
            merged.finish_reason, merged.stop_reason = c.finish_reason, c.stop_reason
            merged.cumulative_logprob = c.cumulative_logprob  # a running sum: the later one has it all
        self.outputs = sorted(mine.values(), key=lambda c: c.index)
        self.finished, self.num_cached_tokens = later.finished, later.num_cached_tokens
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (`LLM.embed`, vLLM's type)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class PoolingOutput:
    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """One prompt's pooled hidden states as a tensor (`LLM.encode`, vLLM's type)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True

    @classmethod
    def of(cls, embedding: EmbeddingRequestOutput) -> PoolingRequestOutput:
        """An embedding's output as vLLM's pooling calls give it: the vector as a tensor."""
        import torch

        return cls(embedding.request_id, embedding.prompt_token_ids,
                   PoolingOutput(torch.tensor(embedding.outputs.embedding)))


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's score (`LLM.score`, vLLM's type): the cosine similarity of its two embeddings."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int] = field(default_factory=list)  # the pair's two prompts, one after the other
    finished: bool = True
