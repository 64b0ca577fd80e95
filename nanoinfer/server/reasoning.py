"""Reasoning output (vLLM's `--reasoning-parser`): a thinking model writes its reasoning between `<think>` and
`</think>` before the answer; the server returns it as the message's `reasoning_content`, apart from `content`.

- `qwen3`: reasoning when the reply opens with `<think>` (Qwen3 with thinking on); a reply without it is all
  content (thinking off: the chat template already closed an empty think block in the prompt).
- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the reply is reasoning up to `</think>`
  (DeepSeek-R1, QwQ, Qwen3 "Thinking" models); without `</think>` it is all reasoning. A `<think>` the model
  writes itself anyway (older templates) is not part of it.

A reply that a grammar constrains (structured outputs, a required or named tool_choice) is read as `qwen3` reads
any: reasoning only if the grammar writes a `<think>` block first. The grammar applies from the first token, so the
reply cannot reason outside it (vLLM lets the model reason first and applies the grammar after `</think>`).

Like the tool call extractors, one reader serves a stream and a whole reply: fed text as it arrives, it holds
back what may still turn out to be a tag."""

from __future__ import annotations

from nanoinfer.server.tool_calls import release


class ThinkReasoning:
    """One choice's text in, (new reasoning, new content) out."""

    START, END = "<think>", "</think>"

    def __init__(self, opens_in_prompt: bool) -> None:
        self.opens_in_prompt = opens_in_prompt
        self.state = "opening"  # -> reasoning -> content
        self.buffer = ""

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        self.buffer += text
        reasoning = ""
        if self.state == "opening":  # does the reply open with <think>?
            head = self.buffer.lstrip()
            if head.startswith(self.START):
                self.state, self.buffer = "reasoning", head[len(self.START):]
            elif final or not self.START.startswith(head):
                self.state = "reasoning" if self.opens_in_prompt else "content"
            else:
                return "", ""
        if self.state == "reasoning":
            end = self.buffer.find(self.END)
            if end < 0:
                reasoning, self.buffer = release(self.buffer, self.END, final)
                return reasoning, ""
            reasoning, self.buffer, self.state = self.buffer[:end], self.buffer[end + len(self.END):], "content"
        content, self.buffer = self.buffer, ""
        return reasoning, content


REASONING_PARSERS = {"qwen3": False, "deepseek_r1": True}  # --reasoning-parser NAME: does <think> open in the prompt?


def reasoning_reader(parser: str, constrained: bool = False) -> ThinkReasoning:
    """`constrained`: a grammar made the reply, so nothing it did not write was opened in the prompt."""
    return ThinkReasoning(opens_in_prompt=REASONING_PARSERS[parser] and not constrained)
