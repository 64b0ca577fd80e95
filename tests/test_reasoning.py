"""Reasoning output (`--reasoning-parser`): a thinking model's <think> text apart from its answer, whole or
streamed; a grammar that waits for the reasoning to end (engine and server agreeing where it ends); and
chat_template_kwargs, the template variables that turn thinking on and off."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoinfer.sample.structured import apply_token_bitmask
from nanoinfer.sample.think import CONTENT, END, OPENING, REASONING, START, ThinkTags, reply_phase
from nanoinfer.server.reasoning import ThinkReasoning


def read(parser: str, pieces: list[str], phase: str | None = None) -> tuple[str, str]:
    """What a reader makes of `pieces` (a prompt without think tags, unless `phase` says how the reply starts)."""
    reader, reasoning, content = ThinkReasoning(phase or reply_phase(parser, None)), "", ""
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


@pytest.mark.parametrize("parser, last_tag, phase", [
    ("qwen3", None, OPENING), ("qwen3", END, OPENING), ("qwen3", START, REASONING),  # a Thinking-2507 template
    ("deepseek_r1", None, REASONING), ("deepseek_r1", START, REASONING),
    ("deepseek_r1", END, CONTENT),  # the template closed the think block: thinking off
])
def test_a_reply_starts_as_its_prompts_last_think_tag_says(parser, last_tag, phase):
    assert reply_phase(parser, last_tag) == phase


def test_a_reply_is_read_from_its_first_phase():
    """deepseek_r1 after a prompt that closed the think block: all content (it was all reasoning_content). A reply
    whose grammar applied from the first token (tags that are not tokens): reasoning only where the grammar opens
    <think> (a JSON object, tool calls, read as reasoning, were all reasoning_content, content and calls empty)."""
    assert read("deepseek_r1", ["Paris</think>x"], CONTENT) == ("", "Paris</think>x")
    assert read("qwen3", ["<think>a</think>b"], REASONING) == ("a", "b")  # the prompt opened it, the reply again
    assert read("qwen3", ["a</think>b"], REASONING) == ("a", "b")
    strict = ThinkReasoning(OPENING, first_token=True)  # the engine decided: "\n" first, so no think block
    assert strict.feed("\n<think>a</think>b", True) == ("", "\n<think>a</think>b")
    for parser in ("qwen3", "deepseek_r1"):
        assert read(parser, ['{"city": "Paris"}'], OPENING) == ("", '{"city": "Paris"}')
        assert read(parser, ["<think>a</think>{}"], OPENING) == ("a", "{}")


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


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory, smollm2_path) -> tuple[str, str]:
    """(model, tokenizer): a tiny random Llama, and SmolLM2's tokenizer with <think> and </think> added as single
    tokens 49152 and 49153 (not special, so they stay in the text), as Qwen3's and DeepSeek-R1's tokenizers have."""
    from conftest import make_tiny_model
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("thinking")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    tokenizer.add_tokens([START, END])
    tokenizer.save_pretrained(root / "tokenizer")
    make_tiny_model(str(root / "model"), "llama", vocab_size=len(tokenizer))
    return str(root / "model"), str(root / "tokenizer")


THINK, END_THINK = 49152, 49153


def test_think_tags_are_single_tokens_or_none(thinking_model, smollm2_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(thinking_model[1])
    tags = ThinkTags.of(tokenizer, "qwen3", len(tokenizer))
    assert (tags.start, tags.end) == (THINK, END_THINK)
    assert ThinkTags.of(tokenizer, None, len(tokenizer)) is None
    assert ThinkTags.of(tokenizer, "qwen3", 49152) is None  # not in the model's vocabulary
    assert ThinkTags.of(AutoTokenizer.from_pretrained(smollm2_path), "qwen3", 49152) is None  # "<", "think", ">"
    special = AutoTokenizer.from_pretrained(thinking_model[1])
    special.add_special_tokens({"additional_special_tokens": [START, END]})  # hidden from the text: no use
    assert ThinkTags.of(special, "qwen3", len(special)) is None
    deepseek = ThinkTags.of(tokenizer, "deepseek_r1", len(tokenizer))
    newline = tokenizer.encode("\n", add_special_tokens=False)[0]
    for prompt, qwen3_phase, deepseek_phase in [
        ([1, 2], OPENING, REASONING), ([1, THINK], REASONING, REASONING), ([1, THINK, newline], REASONING, REASONING),
        ([THINK, newline, END_THINK, newline], OPENING, CONTENT),  # thinking turned off by the template
        ([END_THINK, THINK], REASONING, REASONING),
        ([THINK, 5], OPENING, REASONING), ([1, END_THINK, 5, 6], OPENING, REASONING),  # tags in a user's text
    ]:
        assert (tags.first_phase(prompt), deepseek.first_phase(prompt)) == (qwen3_phase, deepseek_phase), prompt
    assert [tags.next_phase(OPENING, t) for t in (THINK, END_THINK, 7)] == [REASONING, CONTENT, CONTENT]
    assert [tags.next_phase(REASONING, t) for t in (THINK, END_THINK, 7)] == [REASONING, CONTENT, REASONING]
    assert [tags.next_phase(CONTENT, t) for t in (THINK, END_THINK)] == [CONTENT, CONTENT]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_grammar_waits_until_the_reasoning_ends(thinking_model, async_scheduling):
    """With a reasoning parser the model reasons freely and the grammar shapes what follows </think> (vLLM's
    order). A logit bias stands in for a thinking model: the grammar masks the tags and "a", so any of them in the
    output got there while the grammar waited."""
    from nanoinfer import LLM, SamplingParams, StructuredOutputsParams

    model, tokenizer = thinking_model
    a = 81  # "a"

    def reply(llm, bias, prompt="Is it?", max_tokens=12):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, logit_bias=bias,
                                structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]

    with LLM(model, tokenizer=tokenizer, reasoning_parser="qwen3", kv_cache_memory_bytes=16 << 20,
             async_scheduling=async_scheduling) as llm:
        opened = reply(llm, {THINK: 50, END_THINK: 100})  # the first token may open <think>, nothing else may
        assert opened.token_ids[:2] == [THINK, END_THINK] and opened.text.removeprefix("<think></think>") in ("yes", "no")
        assert reply(llm, {END_THINK: 100}).text in ("yes", "no")  # no <think> first: the grammar from the start
        assert reply(llm, {a: 100}).text in ("yes", "no")
        assert reply(llm, {a: 100}, prompt=[5, 6, THINK]).text == "a" * 12  # the prompt opened it
        assert reply(llm, {a: 100}, prompt=[5, THINK, 6]).text in ("yes", "no")  # a tag in the user's text
    with LLM(model, tokenizer=tokenizer, reasoning_parser="deepseek_r1", kv_cache_memory_bytes=16 << 20,
             async_scheduling=async_scheduling) as llm:
        free = reply(llm, {a: 100})  # the template opened <think>: reasoning until </think>
        assert free.text == "a" * 12 and free.finish_reason == "length"
        ended = reply(llm, {END_THINK: 100})
        assert ended.token_ids[0] == END_THINK and ended.text.removeprefix("</think>") in ("yes", "no")
        assert ended.finish_reason == "stop"
        assert reply(llm, {a: 100}, prompt=[5, THINK, 6, END_THINK]).text in ("yes", "no")  # thinking turned off
        assert reply(llm, {a: 100}, prompt=[5, END_THINK, 6]).text == "a" * 12  # a tag in the user's text


def test_a_reasoning_grammar_resumes_where_it_was(thinking_model):
    """After a preemption a request's grammar is made again from its tokens: it must stand where the step-by-step
    one stood (phase and matcher), and mask the same: reasoning rows nothing, an opening row the grammar and
    <think>, an answer row the grammar."""
    from transformers import AutoTokenizer

    from nanoinfer import StructuredOutputsParams
    from nanoinfer.sample.structured import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(thinking_model[1])
    compiler = GrammarCompiler(tokenizer, len(tokenizer), "qwen3")
    spec = StructuredOutputsParams(choice=["yes", "no"])
    yes = tokenizer.encode("yes", add_special_tokens=False)
    prompt = [1, 2]
    for output in ([], [THINK], [THINK, 81, 81], [THINK, 81, END_THINK], [THINK, END_THINK, *yes], yes):
        stepped = compiler.request_grammar(spec, prompt, len(prompt))
        compiler.accept([(stepped, t) for t in output])
        resumed = compiler.request_grammar(spec, prompt + output, len(prompt))
        assert resumed.phase == stepped.phase
        assert torch.equal(compiler.bitmask([resumed]), compiler.bitmask([stepped]))
    grammar = compiler.request_grammar(spec, prompt, len(prompt))
    allowed = lambda: set(apply_token_bitmask(torch.zeros(1, len(tokenizer)), torch.tensor([0]),
                                              compiler.bitmask([grammar]))[0].isfinite().nonzero().flatten().tolist())
    plain = compiler.request_grammar(spec, [], 0)
    plain.phase = CONTENT
    answer = set(apply_token_bitmask(torch.zeros(1, len(tokenizer)), torch.tensor([0]),
                                     compiler.bitmask([plain]))[0].isfinite().nonzero().flatten().tolist())
    assert allowed() == answer | {THINK}
    compiler.accept([(grammar, THINK)])
    assert len(allowed()) == len(tokenizer)
    compiler.accept([(grammar, END_THINK)])
    assert allowed() == answer
    compiler.think = ThinkTags(tokenizer, "qwen3", 63, END_THINK)  # a <think> on an int32's sign bit (63 % 32 == 31)
    opening = compiler.request_grammar(spec, prompt, len(prompt))
    mask = compiler.bitmask([opening])
    assert set(apply_token_bitmask(torch.zeros(1, len(tokenizer)), torch.tensor([0]), mask)[0].isfinite().nonzero()
               .flatten().tolist()) == answer | {63}


def test_the_server_reads_reasoning_where_the_engine_ends_it(thinking_model, tmp_path):
    """deepseek_r1 over HTTP, a grammar on each reply: the reasoning (free of the grammar) is reasoning_content and
    the grammar's answer the content; after a prompt that closed the think block, all is content and follows the
    grammar. Streamed as whole."""
    import httpx
    from test_server import launch_server

    model, tokenizer = thinking_model
    server = launch_server(str(tmp_path / "server.log"), model, "--tokenizer", tokenizer,
                           "--reasoning-parser", "deepseek_r1", "--chat-template", THINKING_TEMPLATE)
    try:
        def message(bias: dict, **extra) -> tuple[dict, str]:
            body = {"messages": [{"role": "user", "content": "Is it?"}], "max_tokens": 12, "temperature": 0,
                    "logit_bias": {str(k): v for k, v in bias.items()}, "structured_outputs": {"choice": ["yes", "no"]}}
            whole = httpx.post(f"{server.url}/v1/chat/completions", json=body | extra, timeout=120).json()
            chunks = []
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body | extra | {"stream": True},
                              timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        chunks += json.loads(line[6:])["choices"]
            streamed = [("".join(c["delta"].get(key) or "" for c in chunks)) for key in ("reasoning_content", "content")]
            choice = whole["choices"][0]
            assert streamed == [choice["message"]["reasoning_content"] or "", choice["message"]["content"] or ""]
            return choice["message"], choice["finish_reason"]

        reasoning, finish = message({81: 100})
        assert (reasoning["reasoning_content"], reasoning["content"], finish) == ("a" * 12, None, "length")
        answered, finish = message({END_THINK: 100})
        assert answered["reasoning_content"] is None and answered["content"] in ("yes", "no") and finish == "stop"
        off, _ = message({81: 100}, chat_template_kwargs={"enable_thinking": False})
        assert off["reasoning_content"] is None and off["content"] in ("yes", "no")
        asked = {"messages": [{"role": "user", "content": "What does </think> mean?"}]}  # not the template's tag
        thinking, _ = message({81: 100}, **asked)
        assert (thinking["reasoning_content"], thinking["content"]) == ("a" * 12, None)
    finally:
        assert server.stop() == 0, server.log()
