"""Reasoning output (`reasoning_parser`): a thinking model writes its reasoning between `<think>` and `</think>`
before the answer; the server returns it as the message's `reasoning_content`, apart from `content`.

Where a reply starts is decided by sample/think.py's rule, the one the engine follows too:
- `qwen3`: reasoning when the reply opens with `<think>` (Qwen3 with thinking on); a reply without it is all
  content (thinking off: the chat template already closed an empty think block in the prompt).
- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the reply is reasoning up to `</think>`
  (DeepSeek-R1, QwQ, Qwen3 "Thinking" models); without `</think>` it is all reasoning. A `<think>` the model
  writes itself anyway (older templates) is not part of it. After a prompt whose think block is closed (thinking
  turned off in the template) the reply is all content.
- Either: a prompt that leaves `<think>` open makes the reply reasoning from its first token.

With a grammar (structured outputs, a required or named tool_choice) the engine lets the model reason freely and
applies the grammar after `</think>`, as vLLM does, so such a reply is read like any other. That needs the tags
as single tokens of the tokenizer (Qwen3's, DeepSeek-R1's and QwQ's are): otherwise the grammar applies from the
first token, and a reply it constrains reasons only where the grammar writes a `<think>` block.

Like the tool call extractors, one reader serves a stream and a whole reply: fed text as it arrives, it holds
back what may still turn out to be a tag."""

from __future__ import annotations

from nanoinfer.sample.think import CONTENT, END, REASONING, START
from nanoinfer.server.tool_calls import release


class ThinkReasoning:
    """One choice's text in, (new reasoning, new content) out, from the reply's first phase (think.py)."""

    def __init__(self, phase: str) -> None:
        self.opens_in_prompt = phase == REASONING  # a <think> the reply still writes first is no reasoning of its
        self.state = CONTENT if phase == CONTENT else "opening"  # -> reasoning -> content
        self.buffer = ""

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        self.buffer += text
        reasoning = ""
        if self.state == "opening":  # does the reply open with <think>?
            head = self.buffer.lstrip()
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
