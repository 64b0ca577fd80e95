"""What a request's input may look like, with vLLM's names: the prompt forms `generate` takes (text, token ids,
`TextPrompt`, `TokensPrompt`) and the text of a chat message's content."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NotRequired, TypedDict, Union


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine."""

    prompt: str
    cache_salt: NotRequired[str]  # prefix-cache blocks are shared only between prompts of the same salt


class TokensPrompt(TypedDict):
    """A tokenized prompt; `prompt`: the text the ids stand for, which outputs report."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]

# Content parts that are text (OpenAI's "text", the Responses API's "input_text" / "output_text"); a "refusal"
# part holds its text under "refusal".
_TEXT_PART_TYPES = ("text", "input_text", "output_text")


def content_text(content: object) -> object:
    """A chat message's content as one text: a list of text parts joined by newlines, as vLLM joins them (any
    other content as it is). ValueError for a part that is not text (images and audio are not supported)."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        key = "refusal" if kind == "refusal" else "text" if kind in _TEXT_PART_TYPES else None
        if key is None or not isinstance(part.get(key), str):
            raise ValueError(f"content parts must be text (type text, input_text, output_text or refusal, with its "
                             f"text), got {part!r:.80}")
        texts.append(part[key])
    return "\n".join(texts)
