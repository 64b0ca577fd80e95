"""Where a thinking model's reasoning ends (`reasoning_parser`). A thinking model writes its reasoning between
`<think>` and `</think>`, then the answer. Two parts of nanoinfer must agree on where that boundary falls:

- the sampler holds a request's grammar (structured outputs) while the reply reasons, as vLLM does: the model
  thinks freely, and the grammar shapes what follows `</think>`;
- the server returns what comes before it as `reasoning_content` (server/reasoning.py).

Both start from one rule, `reply_phase`: a reply's first phase follows from the parser and a think tag the
prompt ends with (its template's generation prompt), and its reasoning ends at the first `</think>` after that."""

from __future__ import annotations

from typing import Sequence

START, END = "<think>", "</think>"
OPENING, REASONING, CONTENT = "opening", "reasoning", "content"  # the phases of a reply

# --reasoning-parser NAME -> whether its models' chat templates open <think> in the prompt:
# qwen3 (Qwen3 with thinking on writes <think> itself), deepseek_r1 (DeepSeek-R1, QwQ, Qwen3 "Thinking" models).
REASONING_PARSERS = {"qwen3": False, "deepseek_r1": True}


def reply_phase(parser: str, last_tag: str | None) -> str:
    """How a reply begins, given the think tag its prompt ends with (`START`, `END`, or None for neither).

    REASONING: the prompt left a `<think>` open (a deepseek_r1 template does so without one showing here, and a
    `<think>` the model writes first is part of the opening, not of the reasoning). OPENING (qwen3): the reply
    reasons only if its first token is `<think>`. CONTENT (deepseek_r1): the prompt closed the think block
    (thinking turned off in the template), so the reply is all answer."""
    if last_tag == START:
        return REASONING
    if not REASONING_PARSERS[parser]:
        return OPENING
    return CONTENT if last_tag == END else REASONING


class ThinkTags:
    """A reasoning parser's tags as single token ids of one tokenizer (Qwen3's, DeepSeek-R1's and QwQ's have
    them, not special, so they stay in the text): what following a reply token by token needs. A tokenizer that
    splits the tags into pieces, or hides them as special tokens, has none; there a grammar applies from the first
    token, and the reply reasons only where the grammar writes a think block (vLLM refuses such a tokenizer)."""

    def __init__(self, tokenizer, parser: str, start: int, end: int) -> None:
        self.tokenizer, self.parser, self.start, self.end = tokenizer, parser, start, end

    @classmethod
    def of(cls, tokenizer, parser: str | None, vocab_size: int) -> "ThinkTags | None":
        """The tags in `tokenizer`, if `parser` is set and each is one plain token of the model's vocabulary."""
        if parser is None or tokenizer is None:
            return None
        ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (START, END)]
        special = set(tokenizer.all_special_ids)
        if not all(len(i) == 1 and i[0] < vocab_size and i[0] not in special for i in ids):
            return None
        return cls(tokenizer, parser, ids[0][0], ids[1][0])

    def first_phase(self, prompt_token_ids: Sequence[int]) -> str:
        """`reply_phase` of a prompt given as token ids. Only a tag at the prompt's end counts (after it, blanks at
        most: the template's generation prompt, `<think>\n` or `<think>\n\n</think>\n\n`): a tag in a user's
        message, or in an earlier turn, says nothing about this reply."""
        for token_id in reversed(prompt_token_ids):
            if token_id == self.start or token_id == self.end:
                return reply_phase(self.parser, START if token_id == self.start else END)
            if self.tokenizer.decode([token_id]).strip():
                break
        return reply_phase(self.parser, None)

    def next_phase(self, phase: str, token_id: int) -> str:
        """The phase after the reply's next token."""
        if phase == OPENING:
            return REASONING if token_id == self.start else CONTENT
        if phase == REASONING and token_id == self.end:
            return CONTENT
        return phase
