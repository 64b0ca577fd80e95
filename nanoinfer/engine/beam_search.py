"""Beam search as vLLM does it: outside the engine, one token per step.

Each step runs every live beam of every prompt as a one-token request that asks for the top 2 x beam_width
logprobs; each beam's candidates extend it, and the beam_width best of a prompt's extensions (by the length-
penalised score) live on. A beam that ends with an end-of-sequence token is complete. The beams share their
prompt's cached blocks (prefix caching), so a step computes little more than each beam's newest tokens.

`BeamSearch` is the state of one prompt's search, advanced by whoever runs the steps: `LLM.beam_search` offline,
the server's `use_beam_search` over HTTP."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nanoinfer.outputs import Logprob, RequestOutput
from nanoinfer.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's: `beam_width` beams (each step asks for 2 x beam_width logprobs: at most the engine's max_logprobs,
    `check_width`),
    `max_tokens` generated tokens at most; `length_penalty`: a sequence's score is its cumulative logprob over
    its length (prompt included, as vLLM's) to this power; `temperature` of each step's sampling (the candidates
    are the top logprobs whatever it is)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r:.40}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r:.40}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r:.40}")
        SamplingParams(temperature=self.temperature)  # checked as sampling checks it (the width: check_width)

    def check_width(self, max_logprobs: int) -> None:
        """An engine refuses requests for more than its max_logprobs logprobs: say so in the search's terms."""
        if 2 * self.beam_width > max_logprobs:
            raise ValueError(f"beam_width {self.beam_width} asks for {2 * self.beam_width} logprobs per step, more "
                             f"than the engine's max_logprobs ({max_logprobs}): at most {max_logprobs // 2}")

    def step_params(self) -> SamplingParams:
        """What each step's one-token request samples with."""
        return SamplingParams(max_tokens=1, logprobs=2 * self.beam_width, temperature=self.temperature,
                              ignore_eos=True)


@dataclass
class BeamSearchSequence:
    """A beam: its tokens (the prompt's, then the generated), each generated token's candidates' logprobs, the
    sum of the chosen tokens' logprobs; `text` (the whole sequence's) and `finish_reason` once the search ends."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None

    def text_token_ids(self, prompt_len: int) -> list[int]:
        """The generated tokens whose text a completion returns: all but an ending end-of-sequence token, whose
        text a sampled request leaves out too (vLLM's server does the same for beams)."""
        return self.tokens[prompt_len : len(self.tokens) - (self.finish_reason == "stop")]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # the best beam_width, best first


class BeamSearch:
    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: set[int],
                 cache_salt: str | None = None) -> None:
        self.params, self.eos_token_ids = params, set() if params.ignore_eos else eos_token_ids
        self.cache_salt = cache_salt  # every step's requests carry the prompt's salt (its prefix-cache tenant)
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]  # live: extended by the next step
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    def advance(self, candidates: list[dict[int, Logprob]]) -> None:
        """One step: `candidates[i]` are live beam i's next tokens with their logprobs."""
        extended = []
        for beam, options in zip(self.beams, candidates, strict=True):
            for token_id, logprob in options.items():
                new = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [options],
                                         beam.cum_logprob + logprob.logprob)
                if token_id in self.eos_token_ids:
                    new.finish_reason = "stop"
                    self.completed.append(new)
                else:
                    extended.append(new)
        self.beams = sorted(extended, key=self._score, reverse=True)[: self.params.beam_width]
        self.steps += 1
        if self.steps == self.params.max_tokens:
            self.completed.extend(self.beams)
            self.beams = []

    def best(self) -> list[BeamSearchSequence]:
        """The beam_width best sequences (complete or cut at max_tokens), best first."""
        best = sorted(self.completed, key=self._score, reverse=True)[: self.params.beam_width]
        for beam in best:
            beam.finish_reason = beam.finish_reason or "length"
        return best

    def _score(self, beam: BeamSearchSequence) -> float:
        """A key that orders beams as vLLM's score, cum_logprob / length ** length_penalty, does. It is taken in
        log space: the power overflows a float for a length_penalty of a few hundred (the score is <= 0, so the
        key is -log(-score))."""
        if beam.cum_logprob >= 0:  # a sure sequence: the best score, 0
            return math.inf
        if beam.cum_logprob == -math.inf:  # an impossible one: the worst
            return -math.inf
        length = len(beam.tokens) - (beam.tokens[-1] in self.eos_token_ids)
        return self.params.length_penalty * math.log(length) - math.log(-beam.cum_logprob)


def live_beams(searches: list[BeamSearch]) -> list[tuple[BeamSearch, BeamSearchSequence]]:
    """The next step's one-token requests: every search's live beams, each with its search (none: all ended)."""
    return [(search, beam) for search in searches for beam in search.beams]


def advance_all(beams: list[tuple[BeamSearch, BeamSearchSequence]], outputs: list[RequestOutput]) -> None:
    """One step of every search that had live beams: `outputs[i]`, beam i's one-token request's output, holds its
    candidates (the logprobs of its one token)."""
    candidates: dict[BeamSearch, list[dict[int, Logprob]]] = {}
    for (search, _), output in zip(beams, outputs, strict=True):
        candidates.setdefault(search, []).append(output.outputs[0].logprobs[0])
    for search, options in candidates.items():
        search.advance(options)
