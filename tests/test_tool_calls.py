"""Tool calling: the extractors that read calls out of a reply (whole or streamed), the schemas that constrain
"required" and named replies, the request checks, and the chat template's view of tools (offline)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoinfer.server.protocol import ApiError, ChatCompletionRequest, parse_body
from nanoinfer.server.tool_calls import (TOOL_CALL_PARSERS, HermesToolCalls, Llama3JsonToolCalls, MistralToolCalls,
                                         NamedToolCall, PythonicToolCalls, RequiredToolCalls, parameters_schema,
                                         required_schema)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                   "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters


def read(extractor, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Feed `pieces` as a stream would; the content and the (name, arguments) of each call, deltas merged."""
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        new_content, deltas = extractor.feed(piece, i == len(pieces) - 1)
        content += new_content
        for delta in deltas:
            if "id" in delta:
                assert delta["index"] == len(calls) and delta["type"] == "function" and delta["id"]
                calls[delta["index"]] = [delta["function"]["name"], ""]
            calls[delta["index"]][1] += delta["function"]["arguments"]
    return content, [tuple(call) for call in calls.values()]


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]


def hermes(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


# ----- hermes (tool_choice "auto") -----


def test_hermes_reads_content_then_calls():
    text = "Let me check." + hermes("get_weather", {"city": "Paris"}) + "\n" + hermes("get_time", {})
    extractor = HermesToolCalls()
    assert read(extractor, [text]) == ("Let me check.", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])
    assert extractor.finish_reason("stop") == "tool_calls" and extractor.finish_reason("length") == "length"


def test_hermes_without_calls_is_content_and_finishes_as_the_model_did():
    extractor = HermesToolCalls()
    assert read(extractor, ["a <tool", "_ca"]) == ("a <tool_ca", [])  # a tag that never completed is text
    assert extractor.finish_reason("stop") == "stop"


def test_hermes_holds_back_what_may_start_a_tag():
    extractor = HermesToolCalls()
    assert extractor.feed("Hi <tool_", False) == ("Hi ", [])
    assert extractor.feed("ca", False) == ("", [])
    content, calls = extractor.feed('ll>{"name": "get_time", "arguments": {}}</tool_call>', True)
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_time"]


def test_hermes_block_that_is_not_a_call_comes_back_as_content():
    text = "x<tool_call>not json</tool_call>" + hermes("get_time", {})
    assert read(HermesToolCalls(), [text]) == ("x<tool_call>not json</tool_call>", [("get_time", "{}")])
    unterminated = '<tool_call>{"name": "get_time", "arguments": {}}'  # cut by max_tokens, yet whole JSON
    assert read(HermesToolCalls(), [unterminated]) == ("", [("get_time", "{}")])
    assert read(HermesToolCalls(), ['<tool_call>{"name": "get_ti']) == ('<tool_call>{"name": "get_ti', [])


def test_hermes_keeps_all_text_that_is_not_a_call():
    """Text after a block that is no call, or after calls, is content (vLLM would return it all as content);
    only blanks between calls are dropped. A call's JSON may hold the closing tag in a string."""
    text = 'Write <tool_call>{"name": ...}</tool_call> to call a tool. Anything else?'
    assert read(HermesToolCalls(), [text]) == (text, [])
    text = hermes("f", {}) + "\n\n" + hermes("g", {}) + "\nDone."
    assert read(HermesToolCalls(), [text]) == ("\nDone.", [("f", "{}"), ("g", "{}")])
    tricky = '<tool_call>{"name": "echo", "arguments": {"text": "a </tool_call> b"}}</tool_call>'
    assert read(HermesToolCalls(), [tricky]) == ("", [("echo", '{"text": "a </tool_call> b"}')])


def test_hermes_without_parallel_calls_keeps_the_first():
    text = hermes("get_weather", {"city": "Rome"}) + hermes("get_time", {})
    assert read(HermesToolCalls(parallel=False), [text]) == ("", [("get_weather", '{"city": "Rome"}')])


_PIECES = st.lists(st.sampled_from(["Hi", " ", "<", ">", "tool", "_call", "</", "\n", "{}", "x", "<tool_call>",
                                    "</tool_call>", hermes("f", {"a": [1, "<tool_call>"]}), hermes("g", {}),
                                    '{"name": "h"}']), max_size=12)


@settings(max_examples=300, deadline=None)
@given(pieces=_PIECES, cuts=st.lists(st.integers(0, 400), max_size=8))
def test_hermes_streamed_in_any_pieces_reads_as_whole(pieces, cuts):
    """Wherever the stream breaks the text (inside a tag, inside the JSON), the content and calls are those of the
    whole text; and what is neither a call nor dropped between calls comes back as content."""
    text = "".join(pieces)
    assert read(HermesToolCalls(), split(text, cuts)) == read(HermesToolCalls(), [text])


# ----- llama3_json and mistral (tool_choice "auto") -----


def test_llama3_json_reads_calls_after_the_python_tag_or_a_brace():
    calls = [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
    extractor = Llama3JsonToolCalls()
    assert read(extractor, [text]) == ("", calls) and extractor.finish_reason("stop") == "tool_calls"
    bare = '\n{"name": "get_weather", "arguments": {"city": "Paris"}};{"name": "get_time"}'  # "arguments" read too
    assert read(Llama3JsonToolCalls(), [bare]) == ("", calls)
    assert read(Llama3JsonToolCalls(parallel=False), [text]) == ("", calls[:1])


def test_llama3_json_reply_that_is_not_calls_is_content():
    extractor = Llama3JsonToolCalls()
    assert read(extractor, ['It is {"name": "x"} I think']) == ('It is {"name": "x"} I think', [])
    assert extractor.finish_reason("stop") == "stop"
    assert read(Llama3JsonToolCalls(), ["<|python"]) == ("<|python", [])  # the tag never completed: text
    cut = '{"name": "get_weather", "parameters": {"ci'  # cut short by max_tokens: the whole reply as it came
    assert read(Llama3JsonToolCalls(), [cut]) == (cut, [])
    after = '{"name": "get_time", "parameters": {}}; and some words'
    assert read(Llama3JsonToolCalls(), [after]) == ("and some words", [("get_time", "{}")])


def test_llama3_json_waits_while_the_reply_may_open_with_the_tag():
    extractor = Llama3JsonToolCalls()
    assert extractor.feed(" <|python_", False) == ("", [])
    assert extractor.feed('tag|>{"name": "get_time", "parameters": {}}', False)[1][0]["function"]["name"] == "get_time"
    other = Llama3JsonToolCalls()
    assert other.feed("<|pyt", False) == ("", []) and other.feed("hon is a language", False) == \
        ("<|python is a language", []) and other.feed(" indeed", True) == (" indeed", [])


def test_mistral_reads_both_call_forms_after_content():
    calls = [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    array = 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", ' \
            '"arguments": {}}]'
    extractor = MistralToolCalls()
    assert read(extractor, [array]) == ("Sure. ", calls) and extractor.finish_reason("stop") == "tool_calls"
    v11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'
    assert read(MistralToolCalls(), [v11]) == ("", calls)
    assert read(MistralToolCalls(parallel=False), [v11]) == ("", calls[:1])


def test_mistral_call_ids_are_nine_letters_and_digits():
    """Mistral's chat templates refuse a conversation whose tool call ids are not 9 alphanumerics."""
    _, deltas = MistralToolCalls().feed('[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_time[ARGS]{}', True)
    ids = [d["id"] for d in deltas]
    assert all(len(i) == 9 and i.isascii() and i.isalnum() for i in ids) and len(set(ids)) == 2


def test_mistral_text_that_is_not_a_call_is_content():
    assert read(MistralToolCalls(), ["no calls [TOOL"]) == ("no calls [TOOL", [])
    assert read(MistralToolCalls(), ["[TOOL_CALLS] what? "]) == ("[TOOL_CALLS] what? ", [])
    cut = '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa'
    assert read(MistralToolCalls(), [cut]) == (cut, [])
    assert read(MistralToolCalls(), ['[TOOL_CALLS]get_time[ARGS]{} then words']) == ("then words", [("get_time", "{}")])
    assert read(MistralToolCalls(), ["[TOOL_CALLS]bad name[ARGS]{}"]) == ("[TOOL_CALLS]bad name[ARGS]{}", [])
    for text in ("[TOOL_CALLS]", "Let me check. [TOOL_CALLS][\n  "):  # a reply ending at the tag keeps its text
        assert read(MistralToolCalls(), [text]) == (text, [])


def test_pythonic_reads_a_list_of_calls():
    calls = [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("get_time", "{}")]
    extractor = PythonicToolCalls()
    assert read(extractor, ['[get_weather(city="Paris", days=[1, 2]), get_time()]']) == ("", calls)
    assert extractor.finish_reason("stop") == "tool_calls"
    llama4 = "<|python_start|>[get_weather(city='Paris', days=(1, 2)), get_time()]<|python_end|>\n"
    assert read(PythonicToolCalls(), [llama4]) == ("", calls)
    assert read(PythonicToolCalls(parallel=False), [llama4]) == ("", calls[:1])
    assert read(PythonicToolCalls(), ['[f(a="])}")] and then']) == ("and then", [("f", '{"a": "])}"}')])


def test_pythonic_sends_each_call_when_it_closes():
    """A call goes out as soon as its ")" arrives, not when the list closes (as vLLM streams them); elements
    after the calls that are not calls, or are cut short, come back as content after them."""
    extractor = PythonicToolCalls()
    content, deltas = extractor.feed('[get_weather(city="Paris"), get_ti', False)
    assert content == "" and [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == \
        [("get_weather", '{"city": "Paris"}')]
    content, deltas = extractor.feed("me()", False)
    assert content == "" and [(d["index"], d["function"]["name"]) for d in deltas] == [(1, "get_time")]
    assert extractor.feed("]", True) == ("", []) and extractor.finish_reason("stop") == "tool_calls"
    assert read(PythonicToolCalls(), ["[f(a=1), 2, g()]"]) == ("2, g()]", [("f", '{"a": 1}')])
    assert read(PythonicToolCalls(), ["[f(a=1), g(b="]) == ("g(b=", [("f", '{"a": 1}')])


def test_pythonic_blanks_after_the_end_tag_are_dropped_however_they_arrive():
    text = "<|python_start|>[get_time()]<|python_end|>\n  Done"
    for cut in range(len(text) + 1):
        assert read(PythonicToolCalls(), [text[:cut], text[cut:]]) == ("Done", [("get_time", "{}")]), cut


@pytest.mark.parametrize("text", ["Hello [f()]", "[f(a=x)]", "[f(1)]", "[f(**k)]", "[1, 2]", "[]", "[f(a={1})]",
                                  '[f(a="cut', "<|python_start|>hi", "<|python", "[f(a=" + "[" * 200 + "]" * 200 + ")]"])
def test_pythonic_reply_that_is_not_calls_of_literals_is_content(text):
    """Positional or computed arguments, a set (no JSON for it), an empty list, a list cut short, nesting past
    what Python parses: the reply comes back whole, as content."""
    extractor = PythonicToolCalls()
    assert read(extractor, [text]) == (text, []) and extractor.finish_reason("stop") == "stop"


_LLAMA_TEXTS = ['<|python_tag|>{"name": "f", "parameters": {"a": "};"}}; {"name": "g", "parameters": {"b": [1, {}]}}',
                ' {"name": "f", "arguments": {}};{"name": "g", "parameters": {}} tail', "Just words; {}",
                '{"name": "f", "parameters": {"a"']
_MISTRAL_TEXTS = ['Hi [TOOL_CALLS][{"name": "f", "arguments": {"a": "[TOOL_CALLS]"}}, {"name": "g", "arguments": {}}]',
                  'x[TOOL_CALLS]f[ARGS]{"a": "}"}[TOOL_CALLS]g[ARGS] {"b": [1]} tail', "[TOOL_CALLS]f[AR",
                  "[TOOL_", "[TOOL_CALLS]f[ARGS]{"]


_PYTHONIC_TEXTS = ["<|python_start|>[f(a='x]'), g(b={'c': [1, (2, 3)]})]<|python_end|> then", ' [f(a="\\")]',
                   "[f(a=1", "<|python_start|> nope", "[f(a=1)] <|python_e", "[f(a=1), 2, g()]", "[f(), g(b=[1,"]


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from([(Llama3JsonToolCalls, t) for t in _LLAMA_TEXTS] +
                            [(MistralToolCalls, t) for t in _MISTRAL_TEXTS] +
                            [(PythonicToolCalls, t) for t in _PYTHONIC_TEXTS]),
       cuts=st.lists(st.integers(0, 200), max_size=10))
def test_llama3_json_mistral_and_pythonic_streamed_in_any_pieces_read_as_whole(case, cuts):
    parser, text = case
    assert read(parser(), split(text, cuts)) == read(parser(), [text])


def test_every_auto_parser_is_served():
    assert set(TOOL_CALL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
    for name, parser in TOOL_CALL_PARSERS.items():
        assert isinstance(chat_request(tools=[WEATHER]).tool_call_extractor(name), parser)


# ----- tool_choice "required" and named -----


def test_required_calls_arrive_as_each_object_completes():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    extractor = RequiredToolCalls()
    first = text.index("}}") + 2
    content, calls = extractor.feed(text[:first], False)
    assert content == "" and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("get_weather", '{"city": "Paris"}')]
    content, calls = extractor.feed(text[first:], True)
    assert content == "" and [(c["index"], c["function"]["name"]) for c in calls] == [(1, "get_time")]
    assert extractor.finish_reason("stop") == "tool_calls"


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=10))
def test_required_streamed_in_any_pieces_reads_as_whole(cuts):
    text = '[{"name": "a", "parameters": {"x": "}"}}, {"name": "b", "parameters": {"y": [1, {"z": 2}]}}]'
    whole = read(RequiredToolCalls(), [text])
    assert whole == ("", [("a", '{"x": "}"}'), ("b", '{"y": [1, {"z": 2}]}')])
    assert read(RequiredToolCalls(), split(text, cuts)) == whole


def test_required_text_cut_short_comes_back_as_content():
    assert read(RequiredToolCalls(), ['[{"name": "a", "para']) == ('[{"name": "a", "para', [])
    assert read(RequiredToolCalls(), ['[{"name": "a", "parameters": {}}, {"na']) == ('{"na', [("a", "{}")])


@pytest.mark.parametrize("parser, text", [
    (HermesToolCalls, '<tool_call>{"name": "f", "arguments": {"s": "\\ud83d", "t": "é"}}</tool_call>'),
    (Llama3JsonToolCalls, '{"name": "f", "parameters": {"s": "\\ud83d", "t": "é"}}'),
    (MistralToolCalls, '[TOOL_CALLS]f[ARGS]{"s": "\\ud83d", "t": "é"}'),
    (PythonicToolCalls, '[f(s="\\ud83d", t="é")]'),
    (RequiredToolCalls, '[{"name": "f", "parameters": {"s": "\\ud83d", "t": "é"}}]'),
])
def test_a_lone_surrogate_escape_in_arguments_stays_an_escape(parser, text):
    """Half a surrogate pair, escaped, decodes to a string UTF-8 cannot carry (the response failed mid-stream):
    the arguments keep it escaped, and mean the same."""
    [(name, arguments)] = read(parser(), [text])[1]
    arguments.encode()
    assert name == "f" and json.loads(arguments) == {"s": "\ud83d", "t": "é"}


def test_surrogate_escapes_in_names_and_python_strings():
    text = '<tool_call>{"name": "f\\udc00", "arguments": {}}</tool_call>'
    assert read(HermesToolCalls(), [text]) == (text, [])  # no function has that name: content
    [(_, arguments)] = read(PythonicToolCalls(), ['[f(s="\\ud83d\\ude00")]'])[1]  # Python keeps the two halves
    assert json.loads(arguments) == {"s": "\U0001F600"}


def test_json_nested_too_deeply_is_text_not_an_error():
    """The json module raises RecursionError past ~1,000 levels: such a "call" is content, not a failed request."""
    deep = "[" * 5000 + "]" * 5000
    text = '<tool_call>{"name": "f", "arguments": ' + deep + "}</tool_call>"
    assert read(HermesToolCalls(), [text]) == (text, [])
    required = '[{"name": "f", "parameters": ' + deep + "}]"
    assert read(RequiredToolCalls(), [required]) == (required, [])


def test_named_call_streams_its_arguments():
    extractor = NamedToolCall("get_weather")
    assert read(extractor, ['{"city"', ': "Rome"', "}"]) == ("", [("get_weather", '{"city": "Rome"}')])
    assert extractor.finish_reason("stop") == "stop"  # as OpenAI's: a call asked for by name


def test_schemas():
    schema = required_schema([WEATHER, CLOCK], parallel=False)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert "maxItems" not in required_schema([WEATHER], parallel=True)
    assert parameters_schema([WEATHER, CLOCK], "get_weather") == WEATHER["function"]["parameters"]
    assert parameters_schema([WEATHER, CLOCK], "get_time") == {"type": "object", "properties": {}}


# ----- the request's checks -----


def chat_request(**fields) -> ChatCompletionRequest:
    return parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("fields, parser, words", [
    ({"tools": [WEATHER]}, None, '"auto" needs a server started with --enable-auto-tool-choice'),
    ({"tool_choice": "required"}, "hermes", "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "hermes",
     "not among the tools"),
    ({"tools": [WEATHER, WEATHER]}, "hermes", "two functions named 'get_weather'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}, "hermes",
     'tool_choice must be "none", "auto", "required" or'),
    ({"tools": [WEATHER], "tool_choice": "always"}, "hermes", 'tool_choice must be "none", "auto", "required" or'),
])
def test_tool_requests_that_cannot_be_served(fields, parser, words):
    with pytest.raises(ApiError, match=words) as e:
        chat_request(**fields).check_tools(parser)
    assert e.value.status == 400


def test_tool_choice_decides_the_grammar_and_the_reader():
    auto = chat_request(tools=[WEATHER])
    assert auto.effective_tool_choice == "auto" and auto.sampling_params(8, None).structured_outputs is None
    assert isinstance(auto.tool_call_extractor("hermes"), HermesToolCalls)
    assert chat_request(tools=[WEATHER], tool_choice="none").tool_call_extractor("hermes") is None
    required = chat_request(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False)
    spec = required.sampling_params(8, None).structured_outputs
    assert json.loads(spec.json) == required_schema([WEATHER, CLOCK], parallel=False) and spec.disable_any_whitespace
    named = chat_request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.sampling_params(8, None).structured_outputs.json) == WEATHER["function"]["parameters"]
    assert isinstance(named.tool_call_extractor(None), NamedToolCall)
    with pytest.raises(ApiError, match="constrains the output itself"):
        chat_request(tools=[WEATHER], tool_choice="required",
                     response_format={"type": "json_object"}).sampling_params(8, None)


def test_messages_with_tool_calls_keep_their_fields():
    request = chat_request(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call-1"}])
    assistant, tool = (m.to_template() for m in request.messages[1:])
    assert assistant == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "call-1"}


def test_required_schema_lifts_the_tools_defs():
    """pydantic (and the openai client's pydantic_function_tool) write nested models as "#/$defs/..." references:
    they must still resolve once the schema sits inside the array of calls."""
    city = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    trip = {"type": "function", "function": {"name": "trip", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/City"}}, "$defs": {"City": city}}}}
    schema = required_schema([trip, WEATHER], parallel=True)
    assert schema["$defs"] == {"City": city} and "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert trip["function"]["parameters"]["$defs"] == {"City": city}  # the request's own schema is left alone
    other = {"type": "function", "function": {"name": "other", "parameters": {"$defs": {"City": {"type": "string"}}}}}
    with pytest.raises(ValueError, match="define \\$defs 'City' differently"):
        required_schema([trip, other], parallel=True)
    for bad in (5, []):  # a 500 (AttributeError) before
        odd = {"type": "function", "function": {"name": "odd", "parameters": {"type": "object", "$defs": bad}}}
        with pytest.raises(ValueError, match="\\$defs of a tool's parameters must be an object"):
            required_schema([odd], parallel=True)


# ----- offline: the chat template sees the tools -----

TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}:{{ t.function.parameters | tojson }};"
    "{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
    "\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def test_offline_chat_passes_tools_to_the_template(tmp_path_factory, smollm2_path):
    from nanoinfer import LLM, SamplingParams
    from test_server import tiny_model_with_smollm2_vocab

    conversation = [{"role": "user", "content": "weather?"},
                    {"role": "assistant", "content": None, "tool_calls": [  # arguments as OpenAI's API sends them
                        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}]
    with LLM(tiny_model_with_smollm2_vocab(tmp_path_factory), tokenizer=smollm2_path, chat_template=TOOLS_TEMPLATE,
             kv_cache_memory_bytes=4_000_000) as llm:
        ids = llm.apply_chat_template(conversation, tools=[WEATHER])
        text = llm.tokenizer.decode(ids)
        assert text == ('<tools>get_weather:{"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, '
                        '"required": ["city"], "additionalProperties": false};</tools>\n<user>weather?'
                        '<assistant>[call get_weather {"city": "Rome"}]<assistant>')  # trim_blocks, as transformers
        assert llm.tokenizer.decode(llm.apply_chat_template(conversation)).startswith("<user>")
        out = llm.chat(conversation, SamplingParams(max_tokens=2), use_tqdm=False, tools=[WEATHER])
        assert out[0].prompt_token_ids == ids
