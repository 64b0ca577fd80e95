"""Structured outputs (xgrammar): the output follows a JSON schema, any JSON object, a regex, one of several
choices or an EBNF grammar; bad grammars are the caller's error; the constraint holds through preemption,
async scheduling and tensor parallelism."""

from __future__ import annotations

import json
import re

import pytest
import torch

from nanoinfer import LLM, SamplingParams, StructuredOutputsParams
from nanoinfer.sample.structured import apply_token_bitmask

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PHONE = r"\d{3}-\d{4}"


def _nested(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for i in range(levels // 2):  # two JSON levels per schema level
        schema = {"type": "object", "properties": {f"k{i}": schema}}
    return schema


def constrained(spec: StructuredOutputsParams, max_tokens: int = 64, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec, **kw)


@pytest.fixture(scope="module")
def smol():
    # Closed, not left to the collector: a failed grammar's exception, re-raised in a test, keeps the test's frame
    # (and the engine) reachable, and a tensor-parallel engine later in the run refuses to start beside it.
    with LLM(kv_cache_memory_bytes=64 << 20) as llm:
        yield llm


def test_smollm2_follows_each_kind_of_grammar(smol: LLM) -> None:
    ask = smol.apply_chat_template([{"role": "user", "content": "Describe a person called Bob, aged 30, as JSON."}])
    person = smol.generate([ask], constrained(StructuredOutputsParams(json=PERSON)), use_tqdm=False)[0].outputs[0]
    assert person.finish_reason == "stop"
    value = json.loads(person.text)
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and isinstance(value["age"], int)
    schema_text = smol.generate([ask], constrained(StructuredOutputsParams(json=json.dumps(PERSON))),
                                use_tqdm=False)[0].outputs[0]
    assert schema_text.text == person.text  # the schema as a dict or as its JSON text: one grammar
    short = smol.apply_chat_template([{"role": "user", "content": "Give a JSON object with one key, city, for Paris."}])
    anything = smol.generate([short], constrained(StructuredOutputsParams(json_object=True)),
                             use_tqdm=False)[0].outputs[0]
    assert anything.finish_reason == "stop" and isinstance(json.loads(anything.text), dict)
    unconstrained = smol.generate([ask], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert not unconstrained.text.startswith("{")  # the grammar, not the prompt, made the JSON

    yes_no = smol.apply_chat_template([{"role": "user", "content": "Is Paris in France? Answer yes or no."}])
    choice = smol.generate([yes_no], constrained(StructuredOutputsParams(choice=["yes", "no", "a (b)?"])),
                           use_tqdm=False)[0].outputs[0]
    assert choice.text in ("yes", "no", "a (b)?") and choice.finish_reason == "stop"
    phone = smol.apply_chat_template([{"role": "user", "content": "Make up a phone number."}])
    number = smol.generate([phone], constrained(StructuredOutputsParams(regex=PHONE)), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(PHONE, number.text) and number.finish_reason == "stop"
    ebnf = 'root ::= "The answer is " [0-9]+ "."'
    answer = smol.generate([yes_no], constrained(StructuredOutputsParams(grammar=ebnf)), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"The answer is \d+\.", answer.text)
    lark = "?start: 'The answer is ' number '.'  // Lark, as vLLM takes it too\nnumber: /[0-9]+/"
    same = smol.generate([yes_no], constrained(StructuredOutputsParams(grammar=lark)), use_tqdm=False)[0].outputs[0]
    assert same.token_ids == answer.token_ids


def test_lark_grammars_become_ebnf() -> None:
    """Lark's notation rewritten for xgrammar: rules (with ? and ! modifiers and priorities), continued alternatives,
    aliases dropped, single quotes, [optional], regex terminals as rules of their own (renamed neither inside
    strings nor inside character classes, and under names no rule holds), start as the root whatever the rule
    order or a rule named root; what EBNF lacks is refused with the line."""
    import xgrammar

    from nanoinfer.sample.lark import is_lark, lark_to_ebnf

    def accepts(text: str, strings: dict[str, bool]) -> None:
        ebnf, root = lark_to_ebnf(text, lambda pattern: str(xgrammar.Grammar.from_regex(pattern)))
        compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo(["a"])).compile_grammar(
            xgrammar.Grammar.from_ebnf(ebnf, root_rule_name=root))
        for string, complete in strings.items():
            matcher = xgrammar.GrammarMatcher(compiled)
            assert (matcher.accept_string(string) and matcher.is_completed()) == complete, (string, ebnf)

    grammar = """greeting: 'hi' | "hello" -> hello  # comment
    | 'it\\'s "x"'
?!start.2: greeting [name] [tag] ("!" | '?')+
name: " " /[A-Z][a-z]*/
tag: " " /root\\/x/ -> tagged
"""
    assert is_lark(grammar) and not is_lark('root ::= "a"  // rule: b')
    ebnf, root = lark_to_ebnf(grammar, lambda pattern: str(xgrammar.Grammar.from_regex(pattern)))
    assert root == "start" and ebnf.splitlines()[:3] == [
        'greeting ::= "hi" | "hello"  | "it\'s \\"x\\""', 'start ::= greeting (name)? (tag)? ("!" | "?")+',
        'name ::= " " name__re0']
    accepts(grammar, {"hi Bob!?": True, "hello root/x?": True, 'it\'s "x" Ann root/x!': True, "hi Bob": False,
                      "hi bob!": False, "hey!": False, 'hi "root/x"!': False})
    accepts("root: 'x' word\nword: /[root]+/", {"xroot": True, "xtoor": True, "xstar": False, "x": False})
    accepts("a: /[a-z]/ a__re0\na__re0: 'z'", {"qz": True, "q": False})
    accepts("start: root 'y'\nroot: 'x'", {"xy": True, "x": False})
    for text, match in (("%import common.WS\nstart: 'a'", "line 1: directives"),
                        ("start: a", "line 1: rule start uses undefined a"),
                        ("start: 'a'..'z'", "ranges"), ("start: 'a'i", "flags"), ("start: ['a'", "never closed"),
                        ("| 'a'", "continues no rule"), ("start = 'a'", "expected 'name: ...'")):
        with pytest.raises(ValueError, match=match):
            lark_to_ebnf(text, lambda pattern: str(xgrammar.Grammar.from_regex(pattern)))


def test_disable_any_whitespace_writes_compact_json(tmp_path_factory, smollm2_path) -> None:
    """A random model pads JSON with blanks until max_tokens; without free whitespace it can only write the
    separators json.dumps writes (and json_object then means an object)."""
    from test_server import tiny_model_with_smollm2_vocab

    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "n": {"enum": [1, 2]}},
              "required": ["city", "n"], "additionalProperties": False}
    llm = LLM(tiny_model_with_smollm2_vocab(tmp_path_factory), tokenizer=smollm2_path, kv_cache_memory_bytes=16 << 20)
    loose, compact, obj = (llm.generate("Weather:", constrained(spec, max_tokens=48), use_tqdm=False)[0].outputs[0]
                           for spec in (StructuredOutputsParams(json=schema),
                                        StructuredOutputsParams(json=schema, disable_any_whitespace=True),
                                        StructuredOutputsParams(json_object=True, disable_any_whitespace=True)))
    assert loose.finish_reason == "length" and sum(map(str.isspace, loose.text)) > len(loose.text) / 2
    assert compact.finish_reason == "stop" and compact.text == json.dumps(json.loads(compact.text))
    assert obj.text.startswith("{") and not obj.text.startswith("{ ")
    assert StructuredOutputsParams(json=schema).key != StructuredOutputsParams(json=schema,
                                                                              disable_any_whitespace=True).key


def test_large_batches_feed_their_matchers_in_threads(smol: LLM, monkeypatch) -> None:
    """GrammarCompiler.accept splits 16 or more (matcher, token) pairs over threads (xgrammar releases the GIL):
    each matcher ends where feeding it alone leaves it."""
    import threading

    compiler = smol.llm_engine.core.runner.grammar_compiler()
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    spec = StructuredOutputsParams(json=PERSON)
    texts = [f'{{"name": "P{i}", "age": {i}' for i in range(40)]
    ids = [smol.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    threaded, alone = ([compiler.request_grammar(spec, [], 0) for _ in texts] for _ in range(2))
    names = set()
    accept = type(threaded[0].matcher).accept_token
    monkeypatch.setattr(type(threaded[0].matcher), "accept_token",
                        lambda m, t: names.add(threading.current_thread().name) or accept(m, t))
    for step in range(max(map(len, ids))):
        compiler.accept([(g, row[step]) for g, row in zip(threaded, ids) if step < len(row)])
    assert any(name.startswith("grammar-accept") for name in names)
    for g, row in zip(alone, ids):
        for t in row:
            g.matcher.accept_token(t)
    assert torch.equal(compiler.bitmask(threaded), compiler.bitmask(alone))
    assert torch.equal(compiler.bitmask(alone)[:8], compiler.bitmask(alone[:8]))  # xgrammar's batch fill = one by one


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_constraints_that_allow_no_token_fail_their_request_alone(smollm2_path, async_scheduling) -> None:
    """A grammar that matches nothing, or one whose tokens allowed_token_ids excludes, leaves no token to sample:
    that request ends with finish_reason "error" (it sampled a stand-in token with NaN logprobs, which the server
    could not write as JSON), and the requests beside it run on."""
    with LLM(kv_cache_memory_bytes=64 << 20, async_scheduling=async_scheduling) as llm:
        impossible = constrained(StructuredOutputsParams(regex="[^\\s\\S]"), 5, logprobs=2)
        disjoint = SamplingParams(temperature=0.8, max_tokens=5, allowed_token_ids=[5, 6],
                                  structured_outputs=StructuredOutputsParams(choice=["hello"]))
        plain = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        outs = llm.generate(["Hi", "Hi", "Hi"], [impossible, plain, disjoint], use_tqdm=False)
        assert [(o.outputs[0].finish_reason, o.outputs[0].token_ids) for o in outs[::2]] == [("error", [])] * 2
        assert outs[1].outputs[0].token_ids == llm.generate(["Hi"], plain, use_tqdm=False)[0].outputs[0].token_ids
        core = llm.llm_engine.core
        assert core.scheduler.kv_cache_manager.num_free_blocks == core.num_blocks


def test_bad_grammars_are_refused_before_the_engine(smol: LLM) -> None:
    core = smol.llm_engine.core
    for spec, error, match in (
        (dict(json={"type": "no-such-type"}), ValueError, "json cannot be compiled"),
        (dict(regex="(unclosed"), ValueError, "regex cannot be compiled"),
        (dict(grammar="root ::= undefined_rule"), ValueError, "grammar cannot be compiled"),
    ):
        with pytest.raises(error, match=match):
            smol.generate(["hi"], constrained(StructuredOutputsParams(**spec)), use_tqdm=False)
    for kwargs, error, match in (
        (dict(), ValueError, "exactly one of"),
        (dict(regex="a", choice=["b"]), ValueError, "exactly one of"),
        (dict(json=3), TypeError, "structured_outputs.json"),
        (dict(choice=[]), TypeError, "structured_outputs.choice"),
        (dict(json_object="yes"), TypeError, "json_object"),
        (dict(json="{not json"), ValueError, "not valid JSON"),
        (dict(json="[1, 2]"), ValueError, "must be a JSON object"),
        (dict(json=_nested(70)), ValueError, "nests deeper than 64 levels"),
    ):
        with pytest.raises(error, match=match):
            StructuredOutputsParams(**kwargs)
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(structured_outputs={"schema": {}})
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a"})
    assert StructuredOutputsParams(json=PERSON).json == json.dumps(PERSON)  # kept as text: flat on the wire
    assert SamplingParams(structured_outputs={"regex": "a"}).structured_outputs == StructuredOutputsParams(regex="a")
    assert not smol.llm_engine.has_unfinished_requests()
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.num_blocks


def test_bitmask_masks_exactly_the_cleared_bits() -> None:
    allowed = [0, 5, 31, 32, 63, 70]
    words = torch.zeros(1, 3, dtype=torch.int64)
    for t in allowed:
        words[0, t // 32] |= 1 << (t % 32)
    bitmask = (words - (words >= 2**31).long() * 2**32).to(torch.int32)  # the same 32 bits, as int32
    logits = torch.zeros(3, 72)
    out = apply_token_bitmask(logits, torch.tensor([1]), bitmask)
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == allowed
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[2]).all() and torch.isfinite(logits).all()


def test_a_finished_grammar_allows_only_stop_tokens(smol: LLM) -> None:
    from nanoinfer.sample.structured import GrammarCompiler

    grammars = GrammarCompiler(smol.tokenizer, smol.llm_engine.limits.vocab_size)
    grammar = grammars.request_grammar(StructuredOutputsParams(choice=["yes"]), smol.tokenizer.encode("yes") +
                                       [smol.tokenizer.eos_token_id], 0)
    assert grammar.matcher.is_terminated()  # what a step planned before the request's end was seen meets (async)
    logits = apply_token_bitmask(torch.zeros(1, grammars.vocab_size), torch.tensor([0]), grammars.bitmask([grammar]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [smol.tokenizer.eos_token_id]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_grammars_hold_through_preemption(smollm2_path, async_scheduling: bool) -> None:
    """Six constrained requests of ~32 tokens in a KV cache of 64: preempted ones resume with their matchers fed the
    tokens they had, so every output still matches, and equals the same request run alone."""
    prompts = [f"Make up phone number {i}." for i in range(6)]
    spec = StructuredOutputsParams(regex=r"\d{3}-\d{4}( ext\. \d{1,6})?")
    params = constrained(spec, max_tokens=24, ignore_eos=True)
    alone = LLM(kv_cache_memory_bytes=64 << 20, async_scheduling=async_scheduling)
    want = [alone.generate([p], params, use_tqdm=False)[0].outputs[0].text for p in prompts]
    tight = LLM(num_kv_blocks=16, block_size=4, async_scheduling=async_scheduling, max_num_batched_tokens=16)
    got = [o.outputs[0].text for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.llm_engine.core.scheduler.num_preemptions > 0
    assert got == want
    assert all(re.fullmatch(r"\d{3}-\d{4}( ext\. \d{1,6})?", text) for text in got), got


def test_a_slow_grammar_delays_only_its_own_request(tiny_models, smollm2_path, monkeypatch, tmp_path_factory) -> None:
    """The core compiles a grammar in threads of its own and admits the request when it is done: meanwhile the
    running requests go on, and so does a request whose grammar compiles quickly (it waited behind the slow one)."""
    import threading
    import time

    from test_server import tiny_model_with_smollm2_vocab

    from nanoinfer.sample.structured import GrammarCompiler

    release = threading.Event()
    compile_ = GrammarCompiler.compile

    def slow(self, spec):
        if spec.regex == "slow":
            assert release.wait(60)
        return compile_(self, spec)

    monkeypatch.setattr(GrammarCompiler, "compile", slow)
    llm = LLM(tiny_model_with_smollm2_vocab(tmp_path_factory), tokenizer=smollm2_path, kv_cache_memory_bytes=16 << 20)
    engine = llm.llm_engine
    # Offline, admission shares the core's compiler and would wait for this compile; the server admits in its own
    # process, so what is left to show is the core's side.
    engine.input_processor.check_grammar = lambda spec: None
    engine.add_request("plain", [1, 2, 3], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.add_request("constrained", [4, 5, 6], constrained(StructuredOutputsParams(regex="slow"), max_tokens=8))
    engine.add_request("quick", [7, 8, 9], constrained(StructuredOutputsParams(regex="quick"), max_tokens=8))
    plain_tokens, quick = 0, None
    for _ in range(20):
        for out in engine.step():
            assert out.request_id in ("plain", "quick")  # the slow one waits for its grammar
            if out.request_id == "plain":
                plain_tokens = len(out.outputs[0].token_ids)
            elif out.finished:
                quick = out.outputs[0].text
    assert plain_tokens >= 15 and quick == "quick"
    assert [r.request_id for r in engine.core.scheduler.waiting] == ["constrained@1"]
    while "plain@0" in engine.core.scheduler.requests or engine.core.in_flight is not None:
        engine.step()
    start = time.monotonic()
    assert engine.step() == []  # nothing runs: the step waits on the grammar (up to 50 ms), not a busy loop
    assert time.monotonic() - start >= 0.04
    release.set()
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finished["constrained"].outputs[0].text == "slow"


def test_offline_a_grammar_compiles_once(smol: LLM, monkeypatch) -> None:
    """In one process, admission's check and the engine core share one compiler and its cache."""
    from nanoinfer.sample.structured import GrammarCompiler

    calls = []
    compile_ = GrammarCompiler.compile
    monkeypatch.setattr(GrammarCompiler, "compile", lambda self, spec: calls.append(spec) or compile_(self, spec))
    spec = StructuredOutputsParams(regex=r"[0-9]{2}-once")
    out = smol.generate(["a", "b"], constrained(spec, max_tokens=8, n=2), use_tqdm=False)
    assert all(re.fullmatch(r"[0-9]{2}-once", c.text) for o in out for c in o.outputs)
    assert calls == [spec]


def test_grammar_keys_are_unambiguous(smol: LLM) -> None:
    """A choice holding the separator of an old key ("yes\\0no") is its own grammar: its failed compilation is not
    another client's ["yes", "no"], nor the other way round."""
    bad, good = StructuredOutputsParams(choice=["yes\x00no"]), StructuredOutputsParams(choice=["yes", "no"])
    assert bad.key != good.key
    compiler = smol.llm_engine.core.runner.grammar_compiler()
    with pytest.raises(ValueError, match="cannot be compiled"):
        compiler.compile_async(bad).result()
    assert compiler.compile_async(good).result() is not None


def test_a_grammar_held_by_a_request_outlives_the_cache(smol: LLM, monkeypatch) -> None:
    """A request's grammar stays compiled while the request holds it, however many grammars came after: its matcher
    (first sampling, or after a preemption) never compiles it again inside a step."""
    from nanoinfer.sample.structured import GrammarCompiler

    calls = []
    monkeypatch.setattr(GrammarCompiler, "compile", lambda self, spec: calls.append(spec.regex) or object())
    compiler = GrammarCompiler(smol.tokenizer, smol.llm_engine.limits.vocab_size)
    held = compiler.compile_async(StructuredOutputsParams(regex="held"))
    for i in range(300):
        compiler.compile_async(StructuredOutputsParams(regex=f"r{i}")).result()
    assert compiler.compile_async(StructuredOutputsParams(regex="held")) is held
    compiler.compile_async(StructuredOutputsParams(regex="r0")).result()  # not held, and pushed out by 256 later
    assert calls.count("held") == 1 and calls.count("r0") == 2 and calls.count("r299") == 1


def test_the_server_checks_a_slow_grammar_beside_other_work(smol: LLM) -> None:
    """The API process: a grammar is checked in threads of its own, awaited on the event loop, so while a slow
    one is checked, another grammar is and the tokenizer thread (large bodies) is free; one thread held up both (a
    7,000-property schema: 19.6 s for a `choice` request, 9.8 s for a plain large body). A client that leaves
    does not cancel the check other requests of the same grammar share."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from nanoinfer.sample.structured import GrammarCache, parse_grammar
    from nanoinfer.server.models import OpenAIServingModels
    from nanoinfer.server.serving import OpenAIServing

    release = threading.Event()
    checks = GrammarCache(lambda spec: (spec.regex != "slow" or release.wait(60)) and parse_grammar(spec))
    client = SimpleNamespace(tokenizer=smol.tokenizer, input_processor=SimpleNamespace(grammar_checks=lambda: checks),
                             config=smol.llm_engine.config, limits=smol.llm_engine.limits)
    serving = OpenAIServing(client, OpenAIServingModels(client, ["m"]))
    slow = StructuredOutputsParams(regex="slow")

    async def run() -> None:
        first = asyncio.create_task(serving._checked(slow))
        leaving = asyncio.create_task(serving._checked(slow))
        await asyncio.wait_for(serving._checked(StructuredOutputsParams(regex="quick")), 30)
        assert await asyncio.get_running_loop().run_in_executor(serving.tokenizer_thread, lambda: "free") == "free"
        leaving.cancel()
        await asyncio.sleep(0.05)
        assert not first.done() and not checks.get(slow).cancelled()
        release.set()
        await asyncio.wait_for(first, 30)

    asyncio.run(run())


def test_the_api_process_parses_and_the_core_fails_what_does_not_compile(smollm2_path, monkeypatch, tmp_path_factory,
                                                                          request) -> None:
    """The server's admission parses a grammar (as vLLM's), never compiling it against the vocabulary (the core
    does that, once); a grammar that parses but does not compile then fails its own request alone in the core
    (finish_reason "error"), the others going on and every block coming back."""
    from test_server import tiny_model_with_smollm2_vocab

    from nanoinfer.engine.input_processor import InputProcessor
    from nanoinfer.sample.structured import GrammarCompiler

    llm = LLM(tiny_model_with_smollm2_vocab(tmp_path_factory), tokenizer=smollm2_path, kv_cache_memory_bytes=16 << 20)
    request.addfinalizer(llm.close)
    engine = llm.llm_engine
    with monkeypatch.context() as patch:  # the API process's input processor (no core beside it)
        patch.setattr(GrammarCompiler, "__init__", lambda *a, **k: pytest.fail("the API process compiled"))
        api = InputProcessor(llm.tokenizer, engine.limits)
        api.check_grammar(StructuredOutputsParams(json=PERSON))
        with pytest.raises(ValueError, match="regex cannot be compiled: .*parenthesis"):
            api.check_grammar(StructuredOutputsParams(regex="a("))
    compile_ = GrammarCompiler.compile
    monkeypatch.setattr(GrammarCompiler, "compile", lambda self, spec: compile_(self, spec) if spec.regex != "boom"
                        else (_ for _ in ()).throw(ValueError("structured_outputs: the regex cannot be compiled: x")))
    engine.input_processor = api  # admission as the server's: the core compiles
    engine.add_request("plain", [1, 2, 3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.add_request("boom", [4, 5, 6], constrained(StructuredOutputsParams(regex="boom"), max_tokens=8))
    engine.add_request("quick", [7, 8, 9], constrained(StructuredOutputsParams(regex="quick"), max_tokens=8))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
    assert finished["boom"].finish_reason == "error" and finished["quick"].text == "quick"
    assert len(finished["plain"].token_ids) == 12
    assert engine.core.scheduler.kv_cache_manager.num_free_blocks == engine.core.num_blocks
