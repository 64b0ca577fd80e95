"""The offline API's contract beyond one generate call: streams read interleaved with each other and with
generate each get their own text; vLLM's dict prompts; conversations checked before the chat template; a
failed step or a closed engine is a clear error for every later call, never a hang; request ids of the
in-process engine (reuse after an abort, a user id that looks like a child's); the collector's full passes
deferred while a call runs."""

from __future__ import annotations

import dataclasses
import gc
import itertools

import pytest

from test_server import tiny_model_with_smollm2_vocab
from nanoinfer import LLM, SamplingParams
from nanoinfer.engine.core import EngineDeadError, defer_full_collections
from nanoinfer.sampling_params import child_seed

PROMPTS = ["The weather today", "Once upon a time", "1, 2, 3,"]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm(tmp_path_factory, smollm2_path) -> LLM:
    return LLM(tiny_model_with_smollm2_vocab(tmp_path_factory), tokenizer=smollm2_path, num_kv_blocks=128)


def assert_no_leak(llm: LLM) -> None:
    assert not llm.llm_engine.has_unfinished_requests() and not llm._inbox and not llm._ready
    assert llm.llm_engine.core.scheduler.kv_cache_manager.num_free_blocks == llm.llm_engine.core.num_blocks


def alone(llm: LLM, prompt, params: SamplingParams) -> str:
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


# ----- streams and generate, interleaved -----


def test_stream_read_around_a_generate_keeps_its_text(llm):
    params = greedy(20)
    expected = alone(llm, PROMPTS[0], params)
    stream = llm.stream(PROMPTS[0], params)
    first = next(stream)
    others = llm.generate(PROMPTS[1:], greedy(8), use_tqdm=False)  # steps the open stream's request too
    assert [o.outputs[0].text for o in others] == [alone(llm, p, greedy(8)) for p in PROMPTS[1:]]
    assert first + "".join(stream) == expected
    assert_no_leak(llm)


def test_two_streams_read_in_turn_each_get_their_own_text(llm):
    expected = [alone(llm, p, greedy(16)) for p in PROMPTS[:2]]
    streams = [llm.stream(p, greedy(16)) for p in PROMPTS[:2]]
    texts = ["", ""]
    for pieces in itertools.zip_longest(*streams, fillvalue=""):
        texts = [t + piece for t, piece in zip(texts, pieces)]
    assert texts == expected
    assert_no_leak(llm)


def test_a_stream_closed_early_gives_its_blocks_back(llm):
    stream = llm.stream(PROMPTS[0], greedy(50))
    next(stream)
    stream.close()
    assert_no_leak(llm)


def test_a_stream_the_collector_finalizes_inside_a_step_is_aborted_after_it(llm, monkeypatch):
    """An open stream left in a reference cycle is closed by whichever collection finds it, maybe one that starts
    inside a step: its abort waits for the step's end (it used to change the step's requests under it, and the
    engine died)."""
    expected = [alone(llm, p, greedy(8)) for p in PROMPTS[1:]]
    stream = llm.stream(PROMPTS[0], greedy(50))
    next(stream)
    cycle = [stream, None]
    cycle[1] = cycle
    del stream, cycle
    kv_cache_manager = llm.llm_engine.core.scheduler.kv_cache_manager
    allocate_slots = kv_cache_manager.allocate_slots

    def collect_then_allocate(*args, **kwargs):
        gc.collect()  # a collection in the middle of scheduling a step
        return allocate_slots(*args, **kwargs)

    monkeypatch.setattr(kv_cache_manager, "allocate_slots", collect_then_allocate)
    assert [o.outputs[0].text for o in llm.generate(PROMPTS[1:], greedy(8), use_tqdm=False)] == expected
    assert_no_leak(llm)


def test_a_stop_string_completed_by_the_last_token_is_the_finish_reason(llm):
    """As vLLM's: the stop string decides finish_reason and stop_reason, even on the token that also reached
    max_tokens."""
    full = llm.generate(["Hello there"], greedy(8), use_tqdm=False)[0].outputs[0]
    before = llm.tokenizer.decode(full.token_ids[:-1])
    stop = next(full.text[i:i + 3] for i in range(len(before), len(full.text) - 2)
                if full.text[i:i + 3].strip() == full.text[i:i + 3])
    assert stop not in before  # only the last token completes it
    out = llm.generate(["Hello there"], greedy(8, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == (
        full.token_ids, full.text[:full.text.index(stop)], "stop", stop)


def test_cumulative_logprob_sums_the_sampled_tokens_logprobs(llm):
    """vLLM's CompletionOutput.cumulative_logprob: with logprobs, the sampled tokens' logprobs summed."""
    out = llm.generate([PROMPTS[0]], greedy(6, logprobs=1), use_tqdm=False)[0].outputs[0]
    assert out.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)))
    assert out.cumulative_logprob < 0
    assert llm.generate([PROMPTS[0]], greedy(6), use_tqdm=False)[0].outputs[0].cumulative_logprob is None


def test_stream_takes_one_completion(llm):
    with pytest.raises(ValueError, match="n must be 1"):
        llm.stream(PROMPTS[0], SamplingParams(n=2))


def test_detokenize_false_gives_the_same_tokens_without_text(llm):
    """vLLM's detokenize=False: the token ids (and logprobs) of detokenize=True, the text left out, no logprob's
    decoded token, prompt logprobs included; stop strings need the text, and streams yield text: both refused."""
    params = greedy(12, logprobs=2, prompt_logprobs=1, stop_token_ids=[7])
    # One at a time: two rows of one batch may round apart on some CPUs' matmul kernels (seen at ~1e-6).
    plain, bare = (llm.generate([PROMPTS[0]], p, use_tqdm=False)[0]
                   for p in (params, dataclasses.replace(params, detokenize=False)))
    assert bare.outputs[0].token_ids == plain.outputs[0].token_ids and plain.outputs[0].text
    assert bare.outputs[0].text == ""
    for ours, theirs in zip(bare.outputs[0].logprobs, plain.outputs[0].logprobs):
        assert {t: (lp.logprob, lp.rank) for t, lp in ours.items()} == \
            {t: (lp.logprob, lp.rank) for t, lp in theirs.items()}
        assert all(lp.decoded_token is None for lp in ours.values())
        assert all(lp.decoded_token is not None for lp in theirs.values())
    assert [lp is None or all(p.decoded_token is None for p in lp.values()) for lp in bare.prompt_logprobs] == \
        [True] * len(bare.prompt_token_ids)
    with pytest.raises(ValueError, match="detokenize=True"):
        SamplingParams(stop=["."], detokenize=False)
    with pytest.raises(TypeError, match="detokenize must be a bool"):
        SamplingParams(detokenize="no")
    with pytest.raises(ValueError, match="detokenize=False"):
        llm.stream(PROMPTS[0], greedy(4, detokenize=False))
    assert_no_leak(llm)


def test_get_tokenizer_is_the_engines(llm, tiny_models):
    assert llm.get_tokenizer() is llm.llm_engine.tokenizer
    assert llm.get_tokenizer().decode(llm.get_tokenizer().encode(PROMPTS[0])) == PROMPTS[0]
    with pytest.raises(ValueError, match="no tokenizer"):
        LLM(tiny_models["llama"], num_kv_blocks=16).get_tokenizer()


# ----- prompts and conversations -----


def test_dict_prompts_as_vllm_takes_them(llm):
    ids = llm.tokenizer.encode(PROMPTS[0])
    outs = llm.generate([{"prompt": PROMPTS[0]}, {"prompt_token_ids": ids, "cache_salt": "tenant"}, ids], greedy(8),
                        use_tqdm=False)
    assert len({o.outputs[0].text for o in outs}) == 1
    assert llm.generate({"prompt": PROMPTS[1]}, greedy(4), use_tqdm=False)[0].prompt == PROMPTS[1]
    # Token ids with the text they stand for (as LLM.chat gives them): the ids run, the output reports the text.
    out = llm.generate({"prompt_token_ids": ids, "prompt": "named"}, greedy(8), use_tqdm=False)[0]
    assert out.prompt == "named" and out.prompt_token_ids == ids and out.outputs[0].text == outs[0].outputs[0].text
    for bad in ({"text": "x"}, {"prompt": "x", "multi_modal_data": {}}, {"cache_salt": "a"}):
        with pytest.raises(ValueError, match="a dict prompt takes 'prompt'"):
            llm.generate([bad], greedy(4), use_tqdm=False)
    with pytest.raises(TypeError, match="'prompt' must be a str"):
        llm.generate([{"prompt_token_ids": ids, "prompt": 5}], greedy(4), use_tqdm=False)
    with pytest.raises(TypeError, match="'prompt_token_ids' must be a list of ints"):  # not tokenized as text
        llm.generate([{"prompt_token_ids": "hello"}], greedy(4), use_tqdm=False)
    assert_no_leak(llm)


def test_text_longer_than_the_context_can_spell_is_refused_before_tokenizing(llm):
    bound = llm.llm_engine.input_processor.max_prompt_chars
    assert bound == llm.llm_engine.limits.max_model_len * max(map(len, llm.tokenizer.get_vocab()))
    with pytest.raises(ValueError, match=f"prompt is {bound + 1} characters long"):
        llm.generate(["x" * (bound + 1)], greedy(4), use_tqdm=False)
    assert_no_leak(llm)


@pytest.mark.parametrize("prompt, error, match", [
    ([[1, 2]], TypeError, "token ids must be Python ints, got list"),
    ("\ud800 lone surrogate", ValueError, "not valid Unicode"),
])
def test_prompt_errors_name_the_problem(llm, prompt, error, match):
    with pytest.raises(error, match=match):
        llm.generate([prompt], greedy(4), use_tqdm=False)
    assert_no_leak(llm)


@pytest.mark.parametrize("messages, error, match", [
    ("hi", TypeError, "for plain text use generate"),
    (["hi"], TypeError, "a conversation must be a non-empty list"),
    ([[]], TypeError, "a conversation must be a non-empty list"),
    ([{"role": "user"}], ValueError, "message 0 needs a 'content': a string or a list of text parts"),
    ([{"role": "user", "content": None}], ValueError, "message 0 needs a 'content'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], ValueError,
     "content parts must be text"),
    ([{"role": "user", "content": [{"type": "text"}]}], ValueError, "content parts must be text"),
    ([{"role": "user", "content": "hi"}, {"content": "x"}], ValueError, "message 1 needs a string 'role'"),
    ([{"role": "user", "content": "hi"}, "x"], TypeError, "message 1 must be a dict"),
])
def test_malformed_conversations_are_named(llm, messages, error, match):
    with pytest.raises(error, match=match):
        llm.chat(messages, greedy(4), use_tqdm=False)
    assert_no_leak(llm)


# ----- sampling params -----


def test_params_changed_after_construction_are_validated_again(llm):
    params = greedy(4)
    params.n = 0
    with pytest.raises(ValueError, match="n must be"):
        llm.generate([PROMPTS[0]], params, use_tqdm=False)
    text = alone(llm, PROMPTS[0], greedy(30))
    stop = text[10:12]
    params = greedy(30)
    params.stop = stop  # a str, normalised to one stop string (not its characters)
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert out.text == text[: text.index(stop)] and out.stop_reason == stop
    assert_no_leak(llm)


def test_child_seeds_wrap_around_the_seed_range(llm):
    top = 2**64 - 1
    assert child_seed(top, 0) == top and child_seed(top, 1) == -(2**63) and child_seed(5, 2) == 7
    outs = llm.generate([PROMPTS[0]], SamplingParams(n=2, seed=top, max_tokens=4), use_tqdm=False)
    assert len(outs[0].outputs) == 2
    assert_no_leak(llm)


# ----- the in-process engine's request ids -----


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(request_id=None), TypeError, "request_id must be a str"),
    (dict(cache_salt=123), TypeError, "cache_salt must be a str"),
    (dict(cache_salt="tenant\ud800"), ValueError, "cache_salt must be valid Unicode text"),  # hashed in a step
    (dict(prompt={"prompt": "hi", "cache_salt": "a"}, cache_salt="b"), ValueError, "cache_salt is given twice"),
])
def test_add_request_checks_its_arguments(llm, kwargs, error, match):
    kwargs = {"request_id": "x", "prompt": [1, 2, 3], "params": greedy(4)} | kwargs
    with pytest.raises(error, match=match):
        llm.llm_engine.add_request(**kwargs)
    assert_no_leak(llm)


def run_all(engine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_the_engine_api_as_vllms(llm):
    """vLLM's LLMEngine: add_request takes any prompt form and returns the id, SamplingParams.output_kind says
    what outputs hold, abort_request takes one id or several, CompletionOutput.finished()."""
    from nanoinfer import RequestOutputKind

    engine = llm.llm_engine
    with pytest.raises(TypeError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")
    delta = greedy(4, output_kind=RequestOutputKind.DELTA)
    with pytest.raises(TypeError):  # vLLM's fourth argument is arrival_time: ours are keywords
        engine.add_request("d", PROMPTS[0], delta, 1.5)
    assert engine.add_request("d", {"prompt": PROMPTS[0], "cache_salt": "t"}, delta) == "d"
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 1, 1, 1]  # DELTA: one new token each
    assert outputs[-1].outputs[0].finished() and not outputs[0].outputs[0].finished()
    for request_id in ("a", "b", "c"):
        engine.add_request(request_id, [1, 2, 3], greedy(50))
    engine.step()
    finals = engine.abort_request(["a", "b", "gone"])
    assert [(f.request_id, f.outputs[0].finish_reason) for f in finals] == [("a", "abort"), ("b", "abort")]
    assert [f.request_id for f in engine.abort_request("c")] == ["c"] and engine.abort_request("c") == []
    assert not engine.has_unfinished_requests()
    assert_no_leak(llm)


def test_an_id_like_a_childs_is_its_own_request(llm):
    engine = llm.llm_engine
    engine.add_request("a", [1, 2, 3], greedy(4, n=2))
    engine.add_request("a#0", [4, 5, 6], greedy(4))
    finals = run_all(engine)
    assert len(finals["a"].outputs) == 2 and len(finals["a#0"].outputs) == 1
    assert_no_leak(llm)


def test_an_id_reused_after_an_abort_gets_only_its_own_tokens(tiny_models):
    """With async scheduling the aborted request's last step is still in flight when the id comes back."""
    llm = LLM(tiny_models["llama"], num_kv_blocks=64, async_scheduling=True)
    engine = llm.llm_engine
    expected = llm.generate([[7, 8, 9]], greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("x", [1, 2, 3, 4], greedy(50))
    for _ in range(3):
        engine.step()
    engine.abort_request("x")
    engine.add_request("x", [7, 8, 9], greedy(6))
    assert run_all(engine)["x"].outputs[0].token_ids == expected
    assert_no_leak(llm)


# ----- a failed step, a closed engine -----


def test_a_failed_step_leaves_a_dead_engine_not_a_hang(tmp_path_factory, smollm2_path, monkeypatch):
    llm = LLM(tiny_model_with_smollm2_vocab(tmp_path_factory), tokenizer=smollm2_path, num_kv_blocks=64)
    runner = llm.llm_engine.core.runner
    calls = itertools.count()
    execute = runner.execute_model

    def interrupted(scheduler_output):
        if next(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C in the middle of a step
        return execute(scheduler_output)

    monkeypatch.setattr(runner, "execute_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2, 3]], greedy(20), use_tqdm=False)
    for call in (lambda: llm.generate([[1, 2, 3]], greedy(4), use_tqdm=False),
                 lambda: list(llm.stream([1, 2, 3], greedy(4)))):
        with pytest.raises(EngineDeadError, match="after a step failed \\(KeyboardInterrupt"):
            call()


def test_a_closed_engine_takes_no_requests(tiny_models):
    llm = LLM(tiny_models["llama"], num_kv_blocks=64)
    assert llm.generate([[1, 2, 3]], greedy(2), use_tqdm=False)
    with llm:
        pass  # leaving the block closes it
    with pytest.raises(EngineDeadError, match="closed"):
        llm.generate([[1, 2, 3]], greedy(2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_sampling_params_copy_is_independent(llm):
    """The running request keeps the params it was admitted with."""
    params = greedy(8)
    expected = alone(llm, PROMPTS[0], params)
    stream = llm.stream(PROMPTS[0], params)
    first = next(stream)
    params.max_tokens = 1
    assert first + "".join(stream) == expected


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    """vLLM's truncate_prompt_tokens: the prompt keeps its last k tokens (-1: max_model_len - 1), and the
    output's prompt is their text; the generation is that of the kept tokens alone."""
    ids = llm.tokenizer.encode("one two three four five six seven eight nine ten")
    greedy = SamplingParams(temperature=0, max_tokens=4)
    cut = llm.generate(ids, dataclasses.replace(greedy, truncate_prompt_tokens=5), use_tqdm=False)[0]
    alone = llm.generate(ids[-5:], greedy, use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-5:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
    text = llm.generate("one two three four five six seven eight nine ten",
                        dataclasses.replace(greedy, truncate_prompt_tokens=3), use_tqdm=False)[0]
    assert text.prompt_token_ids == ids[-3:] and text.prompt == llm.tokenizer.decode(ids[-3:])
    whole = llm.generate(ids, dataclasses.replace(greedy, truncate_prompt_tokens=len(ids) + 5), use_tqdm=False)[0]
    assert whole.prompt_token_ids == ids  # shorter than k: kept whole
    limit = llm.llm_engine.limits.max_model_len
    longest = llm.generate(list(range(1, limit + 40)), SamplingParams(temperature=0, max_tokens=1,
                                                                       truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert len(longest.prompt_token_ids) == limit - 1
    # Text past the length any context could hold is tokenized whole when it is to be cut (a long document).
    document = "x" * llm.llm_engine.input_processor.max_prompt_chars + " the end"
    cut = llm.generate(document, SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=-1),
                       use_tqdm=False)[0]
    assert len(cut.prompt_token_ids) == limit - 1 and cut.prompt.endswith(" the end")
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be >= 1"):
        SamplingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="more than max_model_len"):
        llm.generate(ids, SamplingParams(truncate_prompt_tokens=limit + 1), use_tqdm=False)


def test_truncating_to_fit_keeps_what_a_small_kv_cache_holds(tiny_models) -> None:
    """truncate_prompt_tokens=-1 keeps as many tokens as a request may hold: with a KV cache of fewer tokens than
    max_model_len, the cache's (it kept max_model_len - 1, then refused the request as too long for the cache)."""
    small = LLM(tiny_models["llama"], num_kv_blocks=8, block_size=16)  # 128 tokens, max_model_len 512
    assert small.llm_engine.limits.max_tokens_per_request == 128 < small.llm_engine.limits.max_model_len
    out = small.generate([list(range(1, 200))], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1),
                         use_tqdm=False)[0]
    assert out.prompt_token_ids == list(range(73, 200))  # the last 127


def test_allowed_token_ids_hold_for_every_child_and_step(llm: LLM) -> None:
    """Every token of every child (n = 3, random) is one of the allowed ids, over many steps; a batch-mate without
    them samples freely."""
    allowed = [100, 200, 300, 400]
    limited, free = llm.generate(["Pick:", "Pick:"], [SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=1,
                                                                     ignore_eos=True, allowed_token_ids=allowed),
                                                      SamplingParams(temperature=1.0, max_tokens=12, seed=1,
                                                                     ignore_eos=True)], use_tqdm=False)
    assert all(set(c.token_ids) <= set(allowed) and len(c.token_ids) == 12 for c in limited.outputs)
    assert not set(free.outputs[0].token_ids) <= set(allowed)
    assert_no_leak(llm)


def test_bad_words_are_never_generated(llm: LLM) -> None:
    """bad_words_token_ids (and bad_words, as the tokenizer spells them): a one-token word never appears; a word of
    two tokens is cut at its second token whenever the output has just written its first, which needs the newest
    token on the host before sampling (async scheduling waits for it, as for a grammar)."""
    free = llm.generate("The", greedy(12), use_tqdm=False)[0].outputs[0].token_ids
    one = llm.generate("The", greedy(12, bad_words_token_ids=[[free[1]]]), use_tqdm=False)[0].outputs[0].token_ids
    assert one[0] == free[0] and free[1] not in one
    pair = [free[4], free[5]]
    two = llm.generate("The", greedy(12, bad_words_token_ids=[pair]), use_tqdm=False)[0].outputs[0].token_ids
    assert two[:5] == free[:5] and two[5] != free[5]
    assert not any(two[i:i + 2] == pair for i in range(len(two) - 1))
    twice = [free[1], free[1]]  # a word that repeats a token bans the pair, not the token alone
    assert free[0] != free[1] and SamplingParams(bad_words_token_ids=[twice]).bad_words_token_ids == [twice]
    rep = llm.generate("The", greedy(12, bad_words_token_ids=[twice]), use_tqdm=False)[0].outputs[0].token_ids
    assert rep[:2] == free[:2] and not any(rep[i:i + 2] == twice for i in range(len(rep) - 1))
    word = llm.tokenizer.decode([free[1]]).strip()
    spelled = llm.llm_engine.input_processor._bad_words_token_ids([word])
    assert llm.tokenizer.encode(word, add_special_tokens=False) in spelled
    text = llm.generate("The", greedy(12, bad_words=[word]), use_tqdm=False)[0].outputs[0]
    assert not any(text.token_ids[i:i + len(w)] == w for w in spelled for i in range(len(text.token_ids)))
    assert_no_leak(llm)


def test_generate_takes_a_priority_per_prompt(tiny_models) -> None:
    """vLLM's `priority` argument: under the priority policy, one sequence at a time, prompts are admitted lowest
    value first; a list of the wrong length is an error before anything runs."""
    llm = LLM(tiny_models["qwen3"], scheduling_policy="priority", max_num_seqs=1, device="cpu")
    admitted = []
    schedule = llm.llm_engine.core.scheduler.schedule

    def spy():
        out = schedule()
        admitted.extend(new.prompt_len for new in out.new_reqs)
        return out

    llm.llm_engine.core.scheduler.schedule = spy
    prompts = [[1] * n for n in (3, 4, 5)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False, priority=[2, 0, 1])
    assert admitted == [4, 5, 3] and [len(o.prompt_token_ids) for o in outs] == [3, 4, 5]
    with pytest.raises(ValueError, match="got 3 prompts but 3 params, 2 priorities and 3 LoRA requests"):
        llm.generate(prompts, use_tqdm=False, priority=[0, 1])
    assert_no_leak(llm)
    fcfs = LLM(tiny_models["qwen3"], max_num_seqs=1, device="cpu")  # as vLLM's: a priority would do nothing here
    with pytest.raises(ValueError, match="priority 2 needs scheduling_policy='priority'"):
        fcfs.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False, priority=[2, 0, 1])
    assert_no_leak(fcfs)


def test_chat_continues_the_final_message(llm) -> None:
    """continue_final_message: the reply extends the assistant's last message, as vLLM's LLM.chat does it."""
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two,"}]
    rendered = llm.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert llm.tokenizer.decode(rendered).rstrip().endswith("One, two,")
    params = SamplingParams(temperature=0, max_tokens=4)
    assert llm.chat(messages, params, add_generation_prompt=False, continue_final_message=True,
                    use_tqdm=False)[0].outputs[0].token_ids == \
        llm.generate([rendered], params, use_tqdm=False)[0].outputs[0].token_ids


def test_chat_reports_the_rendered_prompt_and_takes_a_template(llm) -> None:
    """As vLLM's LLM.chat: each output's prompt is the conversation as the template rendered it; chat_template
    (Jinja text) replaces the model's for that call only."""
    messages = [{"role": "user", "content": "Hi!"}]
    out = llm.chat(messages, greedy(2), use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.apply_chat_template(messages)
    assert out.prompt == llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    own = llm.chat(messages, greedy(2), use_tqdm=False, chat_template=template)[0]
    assert own.prompt == "[user] Hi!\n" and own.prompt_token_ids == llm.tokenizer.encode("[user] Hi!\n",
                                                                                         add_special_tokens=False)
    assert llm.apply_chat_template(messages) == out.prompt_token_ids  # the model's template again
    with pytest.raises(ValueError, match="syntax error"):
        llm.chat(messages, greedy(2), use_tqdm=False, chat_template="{% for m in messages %}")
    with pytest.raises(TypeError, match="chat_template must be a str"):
        llm.chat(messages, greedy(2), use_tqdm=False, chat_template=5)
    assert_no_leak(llm)


def test_chat_takes_text_content_parts_as_the_server_does(llm) -> None:
    """OpenAI's content parts (text, input_text, output_text, refusal) are one text joined by newlines, offline
    as on the server (vLLM's LLM.chat parses them the same way)."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi!"}, {"type": "input_text", "text": "Bye."}]},
             {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}]
    joined = [{"role": "user", "content": "Hi!\nBye."}, {"role": "assistant", "content": "No."}]
    assert llm.apply_chat_template(parts) == llm.apply_chat_template(joined)
    assert llm.chat(parts, greedy(3), use_tqdm=False)[0].outputs[0].token_ids == \
        llm.chat(joined, greedy(3), use_tqdm=False)[0].outputs[0].token_ids
    assert_no_leak(llm)


def test_max_logprobs_bounds_what_a_request_may_ask_for(tiny_models) -> None:
    """vLLM's max_logprobs (20 by default; -1: the vocabulary), checked at admission for logprobs and
    prompt_logprobs; a bound past the vocabulary is the vocabulary."""
    small = LLM(tiny_models["llama"], num_kv_blocks=64, max_logprobs=3)
    assert small.llm_engine.limits.max_logprobs == 3
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field} must be at most 3 \\(the engine's max_logprobs\\), got 4"):
            small.generate([[1, 2, 3]], SamplingParams(max_tokens=2, **{field: 4}), use_tqdm=False)
    assert_no_leak(small)
    out = small.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert all(len(lp) >= 3 for lp in out.logprobs)
    vocab = small.llm_engine.limits.vocab_size
    every = LLM(tiny_models["llama"], num_kv_blocks=64, max_logprobs=-1)
    assert every.llm_engine.limits.max_logprobs == vocab == \
        LLM(tiny_models["llama"], num_kv_blocks=64, max_logprobs=10 * vocab).llm_engine.limits.max_logprobs
    out = every.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=vocab), use_tqdm=False)[0].outputs[0]
    assert [len(lp) for lp in out.logprobs] == [vocab, vocab]  # the sampled token is among its top-vocab
    with pytest.raises(ValueError, match=f"logprobs must be at most {vocab}"):
        every.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=vocab + 1), use_tqdm=False)
    whole = every.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=-1, prompt_logprobs=-1),
                           use_tqdm=False)[0]  # -1: the whole vocabulary, as vLLM's
    assert [len(lp) for lp in whole.outputs[0].logprobs] == [vocab, vocab]
    assert [len(lp) for lp in whole.prompt_logprobs[1:]] == [vocab, vocab]
    with pytest.raises(ValueError, match=r"logprobs must be at most 3 .* \(-1: the vocabulary\)"):
        small.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=-1), use_tqdm=False)
    for bad in (-2, True, 1.5):
        with pytest.raises(ValueError, match="max_logprobs must be an integer >= -1"):
            LLM(tiny_models["llama"], num_kv_blocks=64, max_logprobs=bad)


# ----- the collector during a call -----


def test_full_collections_wait_while_a_call_runs_and_come_back_after(tiny_models, monkeypatch):
    """A full pass walks every KV block object: offline calls defer them while their requests run (young passes
    go on), and the thresholds come back after the call, a failed one included."""
    llm = LLM(tiny_models["llama"], num_kv_blocks=64)
    before = gc.get_threshold()
    seen = []
    step = llm.llm_engine.step

    def recording_step():
        seen.append(gc.get_threshold())
        return step()

    monkeypatch.setattr(llm.llm_engine, "step", recording_step)
    llm.generate([[1, 2, 3], [4, 5]], greedy(4), use_tqdm=False)
    assert seen and all(t == (before[0], before[1], 2**31 - 1) for t in seen)
    assert gc.get_threshold() == before

    def failing_step():
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.llm_engine, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2, 3]], greedy(4), use_tqdm=False)
    assert gc.get_threshold() == before


def test_overlapping_calls_restore_the_thresholds_once_the_last_ends():
    before = gc.get_threshold()
    outer = defer_full_collections()
    outer.__enter__()
    with defer_full_collections():
        assert gc.get_threshold()[2] == 2**31 - 1
    assert gc.get_threshold()[2] == 2**31 - 1  # the outer call still runs
    outer.__exit__(None, None, None)
    assert gc.get_threshold() == before


def test_a_run_leaves_no_cyclic_garbage(tiny_models):
    """What deferring full passes relies on: the requests of a call are freed by reference counting alone, so
    nothing waits for the full pass that no longer comes during the call."""
    llm = LLM(tiny_models["llama"], num_kv_blocks=256)
    params = [greedy(8, logprobs=2), SamplingParams(temperature=0.8, seed=1, max_tokens=8, n=2), greedy(8)]
    llm.generate([[1, 2, 3]], greedy(2), use_tqdm=False)  # first-call caches
    gc.collect()
    gc.disable()
    try:
        outs = llm.generate([[i + 1, i + 2, i + 3] for i in range(24)], params * 8, use_tqdm=False)
        assert len(outs) == 24
        del outs
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_vllm_engine_example_runs_as_written(tiny_models) -> None:
    """vLLM's examples/offline_inference/llm_engine_example.py, its imports changed: an engine from EngineArgs,
    TokensPrompt / TextPrompt requests, step() until nothing is unfinished."""
    from nanoinfer import EngineArgs, LLMEngine, TextPrompt, TokensPrompt

    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_models["llama"], num_kv_blocks=64))
    prompts = [TokensPrompt(prompt_token_ids=[1, 2, 3]), TextPrompt(prompt="Hello")] if engine.tokenizer else \
        [TokensPrompt(prompt_token_ids=[1, 2, 3]), TokensPrompt(prompt_token_ids=[4, 5], prompt="four five")]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {out.request_id: out for out in engine.step() if out.finished}
    assert sorted(finished) == ["0", "1"] and all(len(o.outputs[0].token_ids) == 3 for o in finished.values())
    assert finished["1"].prompt == prompts[1]["prompt"]


def fake_hub_cache(root, repo_id: str, folder: str, commit: str = "0" * 40) -> str:
    """A Hugging Face Hub cache holding `folder`'s files as `repo_id` at `commit` (its main branch)."""
    import shutil

    repo = root / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return str(root)


def test_hugging_face_hub_names_load_from_the_cache(tmp_path, tiny_models, smollm2_path, monkeypatch) -> None:
    """As vLLM takes a model name: "org/name" is the Hub repository, here found in its cache (HF_HUB_OFFLINE=1, as
    on machines without a network); `download_dir` names the cache, `revision` a branch. Weights are fetched only
    where they are loaded (not for a tokenizer, nor for dummy weights), and the commits the names resolved to are
    what tensor-parallel workers load. A name the cache lacks is an error that says both readings."""
    import huggingface_hub

    fetched = []
    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, **kw: fetched.append((repo, kw["allow_patterns"])) or real(repo, **kw))
    cache = fake_hub_cache(tmp_path, "org/tiny", tiny_models["llama"], "1" * 40)
    fake_hub_cache(tmp_path, "org/tok", smollm2_path)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    local = LLM(tiny_models["llama"], tokenizer=smollm2_path, num_kv_blocks=16)
    hub = LLM("org/tiny", tokenizer="org/tok", download_dir=cache, revision="main", num_kv_blocks=16)
    assert hub.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids == \
        local.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert hub.get_tokenizer().encode("Hello") == local.get_tokenizer().encode("Hello")
    assert hub.llm_engine.core.source.model_path.startswith(cache)
    assert hub.llm_engine.core.source.hub_revisions == {"revision": "1" * 40, "tokenizer_revision": "0" * 40}
    assert [(repo, "*.safetensors" in patterns) for repo, patterns in fetched] == [("org/tiny", True),
                                                                                   ("org/tok", False)]
    LLM("org/tiny", load_format="dummy", download_dir=cache, num_kv_blocks=16)
    assert fetched[-1] == ("org/tiny", fetched[1][1])  # a config, no weights
    for kwargs, match in (({"download_dir": cache, "revision": "v2"}, "org/tiny' does not exist, and as a Hugging "
                                                                      "Face Hub repository it could not be fetched"),
                          ({}, "could not be fetched or found in the cache")):
        with pytest.raises(FileNotFoundError, match=match):
            LLM("org/tiny", num_kv_blocks=16, **kwargs)
    with pytest.raises(FileNotFoundError, match="tokenizer path '/no/tok' does not exist \\(tokenizers load from"):
        LLM(tiny_models["llama"], tokenizer="/no/tok", num_kv_blocks=16)


def test_vllm_engine_arguments_that_change_nothing_here_are_accepted(tiny_models) -> None:
    """trust_remote_code (no code runs from a model folder), enable_chunked_prefill=True (always on; False is an
    error that says why) and seed=None (a random seed, as vLLM's)."""
    llm = LLM(tiny_models["llama"], num_kv_blocks=16, trust_remote_code=True, enable_chunked_prefill=None, seed=None)
    assert llm.llm_engine.config.enable_chunked_prefill is True  # vLLM's default None: the engine decides
    assert isinstance(llm.llm_engine.config.seed, int)
    with pytest.raises(ValueError, match="enable_chunked_prefill=False is not supported"):
        LLM(tiny_models["llama"], num_kv_blocks=16, enable_chunked_prefill=False)
    with pytest.raises(TypeError, match="trust_remote_code must be True or False"):
        LLM(tiny_models["llama"], num_kv_blocks=16, trust_remote_code="yes")
