"""Reasoning output (`reasoning_parser`): a thinking model writes its reasoning between `<think>` and `</think>`
before the answer; the server returns it as the message's `reasoning_content`, apart from `content`.

Where a reply starts is decided by sample/think.py's rule, the one the engine follows too (only a tag the prompt
ends with counts: one in a user's message says nothing):
- `qwen3`: reasoning when the reply opens with `<think>` (Qwen3 with thinking on); a reply without it is all
  content (thinking off: the chat template already closed an empty think block in the prompt).
- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the reply is reasoning up to `</think>`
  (DeepSeek-R1, QwQ, Qwen3 "Thinking" models); without `</think>` it is all reasoning. A `<think>` the model
  writes itself anyway (older templates) is not part of it. After a prompt whose think block is closed (thinking
  turned off in the template) the reply is all content.
- Either: a prompt that ends with `<think>` open makes the reply reasoning from its first token.

With a grammar (structured outputs, a required or named tool_choice) the engine lets the model reason freely and
applies the grammar after `</think>`, as vLLM does, so such a reply is read like any other. That needs the tags
as single, not special, tokens of the tokenizer (Qwen3's, DeepSeek-R1's and QwQ's are): otherwise the grammar
applies from the first token, and a reply it constrains reasons only where the grammar writes a `<think>` block.
The engine follows tokens and this reader text: a `</think>` the model spells in pieces rather than as its token
ends the reasoning here but not the engine's hold on the grammar (vLLM's text readers share this).

Like the tool call extractors, one reader serves a stream and a whole reply: fed text as it arrives, it holds
back what may still turn out to be a tag."""

from __future__ import annotations

from nanoinfer.sample.think import CONTENT, END, REASONING, START
from nanoinfer.server.tool_calls import release


class ThinkReasoning:
    """One choice's text in, (new reasoning, new content) out, from the reply's first phase (think.py)."""

    def __init__(self, phase: str, first_token: bool = False) -> None:
        """`first_token`: the engine follows the tags as tokens, so only a `<think>` that is the reply's first
        token opens a think block (no blanks before it), as the engine decides."""
        self.opens_in_prompt = phase == REASONING  # a <think> the reply still writes first is no reasoning of its
        self.state = CONTENT if phase == CONTENT else "opening"  # -> reasoning -> content
        self.first_token = first_token
        self.buffer = ""

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        self.buffer += text
        reasoning = ""
        if self.state == "opening":  # does the reply open with <think>?
            head = self.buffer if self.first_token else self.buffer.lstrip()
            if head.startswith(START):
                self.state, self.buffer = REASONING, head[len(START):]
            elif final or not START.startswith(head):
                self.state = REASONING if self.opens_in_prompt else CONTENT
            else:
                return "", ""
        if self.state == REASONING:
            end = self.buffer.find(END)
            if end < 0:
                reasoning, self.buffer = release(self.buffer, END, final)
                return reasoning, ""
            reasoning, self.buffer, self.state = self.buffer[:end], self.buffer[end + len(END):], CONTENT
        content, self.buffer = self.buffer, ""
        return reasoning, content
