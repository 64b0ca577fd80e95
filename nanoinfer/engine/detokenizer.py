"""Incremental detokenization with stop strings, one instance per request.

Decoding token by token is wrong for byte-level and byte-fallback tokenizers:
one character (an emoji, a CJK glyph) can span several tokens, and a token
decoded alone can lose the leading space it has in context. So each step
decodes a short window twice, the already-emitted part (`prefix_offset ..
read_offset`) and the window with the new tokens, and emits the difference,
but only once it no longer ends in U+FFFD (an incomplete character).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from nanoinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded ahead of the first output token, so it gets the same
# text (spaces, merged bytes) as it would in the full sequence: at least the
# first, more (up to the second) until that context starts on a whole character.
_PROMPT_CONTEXT_TOKENS = 5
_MAX_PROMPT_CONTEXT_TOKENS = 24
_INCOMPLETE_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], params: SamplingParams):
        self.stop = params.stop
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # A stream holds back this many characters: they may be the start of a stop string.
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1 if self.stop and not self.include_stop_str_in_output else 0
        )
        # Straight to the Rust tokenizer where there is one: transformers' `decode` wrapper costs ~8x the decode
        # itself, and a server with hundreds of streams decodes two windows per token (bench/RESULTS.md). Its
        # only other work, space clean-up, is off here.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._decode = partial(backend.decode, skip_special_tokens=params.skip_special_tokens)
        else:
            self._decode = partial(tokenizer.decode, skip_special_tokens=params.skip_special_tokens,
                                   clean_up_tokenization_spaces=False)
        self.token_ids = self._prompt_context(prompt_token_ids)
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.num_output_tokens = 0
        self.output_text = ""
        self._streamed_offset = 0

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        """The shortest prompt suffix of at least _PROMPT_CONTEXT_TOKENS tokens that decodes without U+FFFD.

        A byte-fallback tokenizer (Llama-2, Mistral) decodes a run of byte tokens as one: a context starting
        inside a character would turn the output's own bytes, joined to that run, into U+FFFD too. If no suffix
        up to _MAX_PROMPT_CONTEXT_TOKENS is whole (the prompt ends inside a character), the shortest is kept.
        """
        for length in range(_PROMPT_CONTEXT_TOKENS, min(len(prompt_token_ids), _MAX_PROMPT_CONTEXT_TOKENS) + 1):
            context = prompt_token_ids[-length:]
            if _INCOMPLETE_CHAR not in self._decode(context):
                return list(context)
        return list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> tuple[str, int] | None:
        """Append new tokens; if one completes a stop string, return it and how many of the new tokens the
        output keeps (up to that one: a step of drafts may bring tokens past it, which the output never had).

        `stop_terminated`: the last token is an eos / stop token id; as in
        vLLM its text is left out unless include_stop_str_in_output.
        """
        decoded = new_token_ids[:-1] if stop_terminated and not self.include_stop_str_in_output else new_token_ids
        # Token by token, so text completed by early tokens is not held back behind an incomplete character at
        # the end of the batch, and a stop string is found at the token that completed it.
        for kept, token_id in enumerate(decoded, 1):
            checked_length = len(self.output_text)
            self.num_output_tokens += 1
            self.token_ids.append(token_id)
            self.output_text += self._decode_new_text()
            # vLLM only honours stop strings once min_tokens tokens are out.
            if self.stop and self.num_output_tokens > self.min_tokens:
                stop = self._truncate_at_stop(checked_length)
                if stop is not None:
                    return stop, kept
        self.num_output_tokens += len(new_token_ids) - len(decoded)
        return None

    def _decode_new_text(self) -> str:
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_INCOMPLETE_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text) :]

    def _truncate_at_stop(self, checked_length: int) -> str | None:
        """Find the earliest stop string ending past `checked_length` (at the same place, the first in the
        list) and cut the text there. vLLM takes the first in the list that matches, which can keep another stop
        string in the text when one step's tokens complete two; the earliest never does."""
        match: tuple[int, str] | None = None
        for stop in self.stop:
            # Text up to checked_length held no stop string, so a match must end after it.
            index = self.output_text.find(stop, max(0, checked_length - len(stop) + 1))
            if index != -1 and (match is None or index < match[0]):
                match = (index, stop)
        if match is None:
            return None
        index, stop = match
        self.output_text = self.output_text[: index + len(stop) if self.include_stop_str_in_output else index]
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to send now: all of it, or (delta) only what was not sent before.

        Until finished, the last stop_buffer_length characters stay back, so a
        stop string completed by a later token never reaches the client.
        """
        end = len(self.output_text) if finished else max(len(self.output_text) - self.stop_buffer_length, 0)
        if not delta:
            return self.output_text[:end]
        start = self._streamed_offset
        self._streamed_offset = max(start, end)
        return self.output_text[start:end]
