"""Reasoning output (`--reasoning-parser`): a thinking model's <think> text apart from its answer, whole or
streamed; and chat_template_kwargs, the template variables that turn thinking on and off."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoinfer.server.reasoning import reasoning_reader


def read(parser: str, pieces: list[str]) -> tuple[str, str]:
    reader, reasoning, content = reasoning_reader(parser), "", ""
    for i, piece in enumerate(pieces):
        r, c = reader.feed(piece, i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize("parser, text, expected", [
    ("qwen3", "<think>\nweigh it</think>\n\nParis.", ("\nweigh it", "\n\nParis.")),
    ("qwen3", "\n<think>a</think>b", ("a", "b")),  # blanks before the tag
    ("qwen3", "Paris.", ("", "Paris.")),  # thinking off: no tag, all content
    ("qwen3", "Paris <think>x</think>", ("", "Paris <think>x</think>")),  # a tag later on is text
    ("qwen3", "<think>cut short", ("cut short", "")),  # max_tokens inside the reasoning
    ("qwen3", "<thi", ("", "<thi")),  # what looked like the tag's start, at the end, is content
    ("deepseek_r1", "weigh it</think>Paris.", ("weigh it", "Paris.")),  # <think> opened in the prompt
    ("deepseek_r1", "still thinking", ("still thinking", "")),
    ("deepseek_r1", "a</think>b</think>c", ("a", "b</think>c")),
    ("deepseek_r1", "\n<think>\nweigh it</think>Paris.", ("\nweigh it", "Paris.")),  # the model opened it again
    ("deepseek_r1", "<thi", ("<thi", "")),
])
def test_reasoning_apart_from_content(parser, text, expected):
    assert read(parser, [text]) == expected
    assert read(parser, list(text) + [""]) == expected  # a character at a time, as a stream may deliver it


def test_a_constrained_reply_reasons_only_where_its_grammar_opens_think():
    """deepseek_r1 opens <think> in the prompt, but a grammar's reply (a JSON object, tool calls) never closes it:
    read as reasoning it was all reasoning_content, its content and calls empty."""
    for parser in ("qwen3", "deepseek_r1"):
        reader = reasoning_reader(parser, constrained=True)
        assert reader.feed('{"city": "Paris"}', True) == ("", '{"city": "Paris"}')
        reader = reasoning_reader(parser, constrained=True)
        assert reader.feed("<think>a</think>{}", True) == ("a", "{}")


@settings(max_examples=200, deadline=None)
@given(parser=st.sampled_from(["qwen3", "deepseek_r1"]),
       pieces=st.lists(st.sampled_from([" ", "\n", "<", "think", ">", "</", "<think>", "</think>", "a", "bc"]),
                       max_size=10),
       cuts=st.lists(st.integers(0, 80), max_size=6))
def test_streamed_in_any_pieces_reads_as_whole(parser, pieces, cuts):
    text = "".join(pieces)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    streamed = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    reasoning, content = read(parser, [text])
    assert read(parser, streamed) == (reasoning, content)
    assert len(reasoning) + len(content) <= len(text)  # nothing made up; only the tags are dropped


THINKING_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
                     "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")


def test_chat_template_kwargs_reach_the_template(tmp_path_factory, smollm2_path):
    from nanoinfer import LLM
    from test_server import tiny_model_with_smollm2_vocab

    conversation = [{"role": "user", "content": "hi"}]
    with LLM(tiny_model_with_smollm2_vocab(tmp_path_factory), tokenizer=smollm2_path, chat_template=THINKING_TEMPLATE,
             kv_cache_memory_bytes=4_000_000) as llm:
        def text(**kw) -> str:
            return llm.tokenizer.decode(llm.apply_chat_template(conversation, **kw))

        assert text() == "<user>hi<assistant>"
        assert text(chat_template_kwargs={"enable_thinking": False}) == "<user>hi<assistant><think></think>"
        for reserved in ("chat_template", "tokenize", "messages"):  # variables only, not how the template renders
            with pytest.raises(ValueError, match=f"chat_template_kwargs may not set \\['{reserved}'\\]"):
                text(chat_template_kwargs={reserved: "x"})


def test_deepseek_r1_server_leaves_a_grammars_reply_in_content(tmp_path_factory, smollm2_path, tmp_path):
    """--reasoning-parser deepseek_r1 with a JSON schema: the JSON is the content (it was all reasoning_content,
    content empty); reasoning only where the grammar writes a <think> block."""
    import httpx
    from test_server import launch_server, tiny_model_with_smollm2_vocab

    server = launch_server(str(tmp_path / "server.log"), tiny_model_with_smollm2_vocab(tmp_path_factory),
                           "--tokenizer", smollm2_path, "--reasoning-parser", "deepseek_r1")
    try:
        body = {"messages": [{"role": "user", "content": "City?"}], "max_tokens": 40, "temperature": 0}
        schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}},
                  "required": ["city"], "additionalProperties": False}
        compact = {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}  # (no blanks to pad)
        constrained = httpx.post(f"{server.url}/v1/chat/completions", json=body | compact,
                                 timeout=120).json()["choices"][0]["message"]
        assert json.loads(constrained["content"]) == {"city": "Paris"} and constrained["reasoning_content"] is None
        forced = {"structured_outputs": {"regex": "<think>plan</think>done"}}  # a grammar that writes reasoning
        message = httpx.post(f"{server.url}/v1/chat/completions", json=body | forced, timeout=120).json()
        message = message["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("plan", "done")
    finally:
        assert server.stop() == 0, server.log()
