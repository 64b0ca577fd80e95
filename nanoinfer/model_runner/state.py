"""What the model runner remembers about each request between steps, so a
scheduler output only has to carry deltas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from nanoinfer.lora.request import LoRARequest
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.scheduler.output import NewRequestData


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + outputs; the runner appends what it samples
    prompt_len: int
    sampling_params: SamplingParams
    table_row: int  # its row of the runner's BlockTable
    num_computed_tokens: int
    generator: torch.Generator | None
    # A grammar's matcher, and a bad word of several tokens, read the output on the host, so the newest token must
    # be there before sampling.
    needs_newest_token: bool
    grammar: Any = None  # structured outputs: its RequestGrammar, fed every sampled token (ModelRunner)
    penalty_slot: int | None = None  # its token counts in the runner's PenaltyState, from its first sampling
    allowed_mask: torch.Tensor | None = None  # its allowed_token_ids as a [vocab] bool mask, from its first sampling
    pooled: torch.Tensor | None = None  # runner="pooling", MEAN / CLS: what its prompt's chunks so far pooled to
    spare_generators: list[torch.Generator] = field(default_factory=list)  # seeded: rows 1.. of a speculative step
    lora_request: LoRARequest | None = None  # its adapter (enable_lora)
    lora_error: str | None = None  # why its adapter could not be loaded: it fails at its next sampling

    @property
    def sampling_varies(self) -> bool:
        """Whether this request's sampling inputs change from step to step (its grammar's mask, min_tokens' count,
        or its seeded generator's position), so last step's sampling metadata cannot serve again. Penalties do
        not: their counts grow on the device."""
        min_tokens = self.sampling_params.min_tokens  # its mask changes until then (<=: a token may be in flight)
        below_min_tokens = min_tokens > 0 and len(self.token_ids) - self.prompt_len <= min_tokens
        return self.needs_newest_token or self.generator is not None or below_min_tokens

    @classmethod
    def from_new(cls, new: NewRequestData, table_row: int, device: torch.device) -> "CachedRequestState":
        generator = None
        if new.sampling_params.seed is not None:
            generator = torch.Generator(device=device)
        p = new.sampling_params
        reads_output = p.structured_outputs is not None or any(len(w) > 1 for w in p.bad_words_token_ids or ())
        return cls(new.req_id, list(new.all_token_ids), new.prompt_len, p, table_row, new.num_computed_tokens,
                   generator, reads_output, lora_request=new.lora_request)

    def bad_word_ids(self) -> set[int]:
        """The tokens its bad words ban next: each word's last token where the output ends with the rest of it."""
        output = self.token_ids[self.prompt_len:]
        return {word[-1] for word in self.sampling_params.bad_words_token_ids or ()
                if len(word) == 1 or (len(word) - 1 <= len(output) and output[len(output) - len(word) + 1:] == word[:-1])}

    def seeded_generator(self, output_index: int, row: int = 0) -> torch.Generator | None:
        """Seeded sampling depends only on (seed, output position): reproducible
        whatever the batch, after a preemption, with async scheduling, and with speculative decoding (whose
        step samples several positions of the request: `row` of them, each with a generator of its own)."""
        if self.generator is None:
            return None
        while len(self.spare_generators) < row:
            self.spare_generators.append(torch.Generator(device=self.generator.device))
        generator = self.spare_generators[row - 1] if row else self.generator
        generator.manual_seed((self.sampling_params.seed * 1_000_003 + output_index) % (1 << 63))
        return generator

