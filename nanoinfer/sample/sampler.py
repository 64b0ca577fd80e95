"""Turn one step's logits into next tokens (and logprobs), vectorised over the batch.

Order, as in vLLM: allowed_token_ids, logit_bias, min_tokens and bad_words masking, repetition penalty, presence and
frequency penalties; greedy rows then take the argmax; random rows divide by
their temperature, apply top-k, top-p and min-p, and sample. Logprobs are
those of the raw model logits (vLLM v1's default `raw_logprobs`).

How random rows sample:
- The common case on CUDA (all rows random, no top-k/top-p/min-p, no seeds):
  the Triton inverse-CDF sampler (kernels/sampling.py), one uniform per row
  from torch.rand; it reads the logits once and draws 1 number per row instead
  of one per vocabulary entry (the race below cost ~400 us at batch 256 x 152k).
- The same case on CPU: `temperature_sample`, the exponential race without a
  softmax (the PyTorch reference; CI's engine runs it).
- Everything else: the exponential race on the filtered probabilities,
  argmax(probs / q) with q ~ Exp(1), which needs no cumulative sum and lets a
  seeded row draw its own q from its own generator, so its tokens do not
  depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nanoinfer.sample.metadata import SamplingMetadata
from nanoinfer.sample.structured import apply_token_bitmask

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "SamplingMetadata"]


@dataclass
class LogprobsTensors:
    # [B, 1 + max_num_logprobs]: column 0 is the sampled token, then the top-n
    # most likely first. A row that asked for n keeps columns [: 1 + n].
    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    # [B] 1-based rank of the sampled token in the raw distribution.
    selected_token_ranks: torch.Tensor


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None
    # [B] bool, where a request masks tokens (a grammar, allowed_token_ids, bad words): True for a row whose masks
    # left no token to sample (its sampled id is a stand-in, and its request fails); None without masks.
    no_token: torch.Tensor | None = None


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.shape != (metadata.num_rows, metadata.vocab_size):
            raise ValueError(
                f"logits must have shape [{metadata.num_rows}, {metadata.vocab_size}] "
                f"(rows, vocab_size of the metadata), got {list(logits.shape)}"
            )
        # Greedy argmax and the CUDA sampling kernel read the model's dtype as it is, and masking (-inf) holds in
        # any dtype; biases, penalties and logprobs compute in float32 (a no-op for float32 logits), as do the
        # filters (they upcast what they read).
        if metadata.max_num_logprobs is not None or metadata.counted is not None or metadata.logit_bias is not None:
            logits = logits.float()
        if metadata.allowed_tokens is not None:  # structured outputs: only what the grammar allows next; as vLLM's
            logits = apply_token_bitmask(logits, *metadata.allowed_tokens)  # runner, before the logprobs
        raw_logprobs = None if metadata.max_num_logprobs is None else logits.log_softmax(dim=-1)
        logits = apply_allowed_token_ids(logits, metadata)
        logits = apply_logit_bias(logits, metadata)
        logits = apply_banned_tokens(logits, metadata)
        logits = apply_penalties(logits, metadata)
        masked = metadata.allowed_tokens is not None or metadata.allowed_token_ids is not None or \
            metadata.banned_tokens is not None
        no_token = torch.isneginf(logits).all(dim=-1) if masked else None
        sampled = sample(logits, metadata)
        logprobs = None if raw_logprobs is None else gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        if metadata.counted is not None:  # last, once nothing can raise: a failed batch is sampled again row by row
            rows, slots = metadata.counted
            metadata.penalty_state.record(slots, sampled[rows])
        return SamplerOutput(sampled, logprobs, no_token)


def apply_allowed_token_ids(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    if metadata.allowed_token_ids is None:
        return logits
    rows, allowed = metadata.allowed_token_ids
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    if metadata.logit_bias is None:
        return logits
    rows, cols, values = metadata.logit_bias
    return logits.index_put((rows, cols), values, accumulate=True)


def apply_banned_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    if metadata.banned_tokens is None:
        return logits
    return logits.index_put(metadata.banned_tokens, logits.new_full((), float("-inf")))


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Only the penalized rows are read and written (a batch where one request of 256 asks pays for one row)."""
    if metadata.counted is None:
        return logits
    rows, slots = metadata.counted
    state = metadata.penalty_state
    args = (logits, rows, slots, state.output_counts, state.prompt_seen, metadata.repetition_penalties,
            metadata.presence_penalties, metadata.frequency_penalties)
    if logits.is_cuda:
        from nanoinfer.kernels.penalties import penalize_kernel  # triton: optional, CUDA only

        penalized = penalize_kernel(*args)
    else:
        penalized = penalize(*args)
    return penalized if rows.shape[0] == logits.shape[0] else logits.index_put((rows,), penalized)


def penalize(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, output_counts: torch.Tensor,
             prompt_seen: torch.Tensor, repetition: torch.Tensor | None, presence: torch.Tensor | None,
             frequency: torch.Tensor | None) -> torch.Tensor:
    """[len(rows), vocab] float32: the penalized logits of `rows` (sorted), each reading its slot's counts; the
    PyTorch reference of kernels/penalties.py."""
    penalized = (logits if rows.shape[0] == logits.shape[0] else logits[rows]).float()
    counts = output_counts[slots]
    if repetition is not None:
        # HF semantics over prompt + output: shrink the logit of every seen token towards "less likely".
        seen = prompt_seen[slots] | (counts > 0)
        penalty = repetition[rows, None]
        penalized = torch.where(seen, torch.where(penalized > 0, penalized / penalty, penalized * penalty), penalized)
    if frequency is not None:
        # OpenAI semantics, output tokens only: minus frequency * count.
        penalized = penalized - frequency[rows, None] * counts
    if presence is not None:
        # ... and minus presence once for any token already generated.
        penalized = penalized - presence[rows, None] * (counts > 0)
    return penalized


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    greedy = None if metadata.all_random else logits.argmax(dim=-1)
    if metadata.all_greedy:
        return greedy
    if metadata.all_random and not metadata.generators and metadata.top_k is None and metadata.top_p is None \
            and metadata.min_p is None:
        if logits.is_cuda:
            from nanoinfer.kernels.sampling import sample_from_logits  # triton: optional, CUDA only

            return sample_from_logits(logits, metadata.temperature,
                                      torch.rand(logits.shape[0], device=logits.device))
        return temperature_sample(logits.float(), metadata.temperature)
    random = exponential_race(apply_filters(logits.float(), metadata).softmax(dim=-1), metadata.generators)
    return random if metadata.all_random else torch.where(metadata.is_greedy, greedy, random)


def apply_filters(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Temperature, then min-p, then top-k / top-p (vLLM's order: min-p and top-p do not commute): filtered-out
    tokens become -inf."""
    logits = logits / metadata.temperature[:, None]
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    if metadata.top_p is not None:
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    elif metadata.top_k is not None:
        logits = apply_top_k(logits, metadata.top_k, metadata.max_top_k)
    return logits


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Top-k without a full sort: one topk of the largest k, then a per-row threshold."""
    top_values = logits.topk(max_top_k, dim=-1).values
    kth = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1)[:, None])
    # Rows with top_k == vocab_size have it off.
    kth = kth.masked_fill(top_k[:, None] >= logits.shape[1], float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """One ascending sort serves both filters; ties with the k-th value are kept."""
    sorted_logits, order = logits.sort(dim=-1)
    vocab_size = logits.shape[1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab_size - top_k)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # Drop a token when the tokens at or below it hold at most 1 - top_p, i.e.
    # the tokens above it already reach top_p; the most likely token always stays.
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p[:, None]
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens with prob >= min_p * max prob, compared in log space (no softmax needed)."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]
    return logits.masked_fill(logits < threshold, float("-inf"))


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    # The CPU kernel can return exactly 0, and 0 / 0 = NaN would win the argmax.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


def temperature_sample(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The common case (no filters, no seeds) on CPU, in one pass: argmax(softmax(l / T) / q)
    equals argmax(l / T - log q), so no softmax is needed (CUDA uses kernels/sampling.py)."""
    q = torch.empty_like(logits).exponential_().clamp_min(torch.finfo(logits.dtype).tiny)
    return (logits / temperature[:, None] - q.log()).argmax(dim=-1)


def gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    sampled_logprobs = raw_logprobs.gather(1, sampled[:, None])
    # Counting ties as better gives the sampled token its worst rank, as vLLM does.
    ranks = (raw_logprobs >= sampled_logprobs).sum(dim=-1)
    top_logprobs, top_ids = raw_logprobs.topk(num_logprobs, dim=-1)
    return LogprobsTensors(
        logprob_token_ids=torch.cat([sampled[:, None], top_ids], dim=1),
        logprobs=torch.cat([sampled_logprobs, top_logprobs], dim=1),
        selected_token_ranks=ranks,
    )
