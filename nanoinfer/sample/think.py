"""Where a thinking model's reasoning ends (`reasoning_parser`). A thinking model writes its reasoning between
`<think>` and `</think>`, then the answer. Two parts of nanoinfer must agree on where that boundary falls:

- the sampler holds a request's grammar (structured outputs) while the reply reasons, as vLLM does: the model
  thinks freely, and the grammar shapes what follows `</think>`;
- the server returns what comes before it as `reasoning_content` (server/reasoning.py).

Both start from one rule, `reply_phase`: a reply's first phase follows from the parser and the last think tag
of its prompt, and its reasoning ends at the first `</think>` after that."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

START, END = "<think>", "</think>"
OPENING, REASONING, CONTENT = "opening", "reasoning", "content"  # the phases of a reply

# --reasoning-parser NAME -> whether its models' chat templates open <think> in the prompt:
# qwen3 (Qwen3 with thinking on writes <think> itself), deepseek_r1 (DeepSeek-R1, QwQ, Qwen3 "Thinking" models).
REASONING_PARSERS = {"qwen3": False, "deepseek_r1": True}


def reply_phase(parser: str, last_tag: str | None) -> str:
    """How a reply begins, given its prompt's last think tag (`START`, `END`, or None for neither).

    REASONING: the prompt left a `<think>` open (a deepseek_r1 template does so without one showing here, and a
    `<think>` the model writes first is part of the opening, not of the reasoning). OPENING (qwen3): the reply
    reasons only if its first token is `<think>`. CONTENT (deepseek_r1): the prompt closed the think block
    (thinking turned off in the template), so the reply is all answer."""
    if last_tag == START:
        return REASONING
    if not REASONING_PARSERS[parser]:
        return OPENING
    return CONTENT if last_tag == END else REASONING


@dataclass(frozen=True)
class ThinkTags:
    """A reasoning parser's tags as single token ids of one tokenizer (Qwen3's, DeepSeek-R1's and QwQ's have
    them): what following a reply token by token needs. A tokenizer that splits the tags into pieces has none;
    there a grammar applies from the first token, and the reply reasons only where the grammar writes a think
    block (vLLM refuses such a tokenizer with a reasoning parser)."""

    parser: str
    start: int
    end: int

    @classmethod
    def of(cls, tokenizer, parser: str | None, vocab_size: int) -> "ThinkTags | None":
        """The tags in `tokenizer`, if `parser` is set and each is one token of the model's vocabulary."""
        if parser is None or tokenizer is None:
            return None
        ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (START, END)]
        if not all(len(i) == 1 and i[0] < vocab_size for i in ids):
            return None
        return cls(parser, ids[0][0], ids[1][0])

    def first_phase(self, prompt_token_ids: Sequence[int]) -> str:
        """`reply_phase` of a prompt given as token ids."""
        start, end = _last_index(prompt_token_ids, self.start), _last_index(prompt_token_ids, self.end)
        return reply_phase(self.parser, None if start == end else START if start > end else END)

    def next_phase(self, phase: str, token_id: int) -> str:
        """The phase after the reply's next token."""
        if phase == OPENING:
            return REASONING if token_id == self.start else CONTENT
        if phase == REASONING and token_id == self.end:
            return CONTENT
        return phase


def _last_index(ids: Sequence[int], token_id: int) -> int:
    """The position of the last `token_id` in `ids`, -1 if none (a reversed copy searched in C: a Python loop
    over a long prompt would take milliseconds)."""
    try:
        return len(ids) - 1 - list(reversed(ids)).index(token_id)
    except ValueError:
        return -1
