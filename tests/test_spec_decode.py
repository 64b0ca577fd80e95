"""Speculative decoding by n-gram lookup: the proposer, its settings, and end to end the one promise it makes:
the output is exactly what decoding without drafts gives (greedy, seeded sampling, logprobs, stops, limits),
while a step yields several tokens. The scheduler's side (drafts within the budget, rejected drafts' KV
rewritten before it is read, preemption) is in test_scheduler.py's harness and property tests."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoinfer import LLM, SamplingParams
from nanoinfer.config import EngineConfig
from nanoinfer.spec_decode.ngram import NgramProposer, SpeculativeConfig

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SMALL_KV = 64 << 20


def proposer(k: int = 3, high: int = 3, low: int = 1) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(k, high, low))


# ----- the proposer -----


def test_proposes_what_followed_the_latest_longest_match():
    p = proposer()
    assert p.propose("r", [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3], 10) == [4, 7, 8]  # "2 3" last seen before "4 7 8"
    assert p.propose("s", [7, 2, 3, 9, 9, 1, 2, 3, 5, 1, 2, 3], 10) == [5, 1, 2]  # "1 2 3" beats a later "2 3"
    assert p.propose("t", [1, 2, 3, 1, 2], 10) == [3, 1, 2]  # the drafts may run into the suffix itself


def test_proposes_nothing_without_a_long_enough_match_or_room():
    assert proposer().propose("r", [1, 2, 3, 4], 10) == []
    assert proposer().propose("r", [5], 10) == []
    assert proposer(low=2).propose("r", [4, 1, 9, 1], 10) == []  # only a 1-gram repeats
    assert proposer().propose("r", [1, 2, 1, 2], 0) == []
    assert proposer().propose("r", [1, 2, 1, 2], 1) == [1]


def brute_force(tokens: list[int], k: int, high: int, low: int) -> list[int]:
    """The longest suffix of low..high tokens seen before; of its occurrences the latest; what followed it."""
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=40), st.integers(1, 5), st.integers(1, 4), st.integers(1, 4),
       st.integers(0, 6))
def test_proposer_matches_a_brute_force_search(tokens, k, high, low, room):
    low, high = min(low, high), max(low, high)
    assert proposer(k, high, low).propose("r", tokens, room) == brute_force(tokens, min(k, room), high, low)[:room]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=300), st.lists(st.integers(1, 9), max_size=40))
def test_a_growing_request_is_searched_as_a_whole(tokens, cuts):
    """One request's tokens grow between its proposals (the buffer copies only the new ones, doubling as it
    fills); a finished request's id starts anew."""
    p, end = proposer(3, 3, 1), 1
    for cut in cuts + [len(tokens)]:
        end = min(len(tokens), end + cut)
        assert p.propose("r", tokens[:end], 3) == brute_force(tokens[:end], 3, 3, 1)
    p.forget("r")
    assert p.propose("r", tokens[:2], 3) == brute_force(tokens[:2], 3, 3, 1)


# ----- settings -----


def test_config_takes_vllms_form_and_defaults():
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2}) == SpeculativeConfig(2, 5, 5)
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "prompt_lookup_max": 4}) == \
        SpeculativeConfig(2, 4, 4)
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "prompt_lookup_min": 2}) == \
        SpeculativeConfig(2, 2, 2)
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 2, "disable_by_batch_size": 8}) == \
        SpeculativeConfig(2, 5, 5, disable_by_batch_size=8)
    assert EngineConfig(speculative_config=SPEC).speculative == SpeculativeConfig(4, 3, 1)
    assert EngineConfig().speculative is None


@pytest.mark.parametrize("config, match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported"),
    ({"prompt_lookup_max": 2}, "num_speculative_tokens is required"),
    ({"num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1, 64\]"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "larger than prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "model": "x"}, r"unknown key\(s\) \['model'\]"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, r"prompt_lookup_min must be an integer in \[1, 64\]"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size must be a positive integer"),
    ([2], "must be a dict"),
])
def test_bad_settings_are_named(config, match):
    with pytest.raises((ValueError, TypeError), match=match):
        EngineConfig(speculative_config=config)


def test_pooling_takes_no_drafts():
    with pytest.raises(ValueError, match="runner='generate' only"):
        EngineConfig(runner="pooling", speculative_config=SPEC)


# ----- end to end -----

CHATS = [[{"role": "user", "content": "Repeat this list three times: apple, banana, cherry, dates, fig, grape."}],
         [{"role": "user", "content": "Write the numbers from 1 to 30, separated by commas."}],
         [{"role": "user", "content": "Copy this sentence: the quick brown fox jumps over the lazy dog."}]]


@pytest.fixture(scope="module")
def smol_pair() -> tuple[LLM, LLM]:
    return LLM(kv_cache_memory_bytes=SMALL_KV), LLM(kv_cache_memory_bytes=SMALL_KV, speculative_config=SPEC)


def _run(llm: LLM, params: SamplingParams) -> list:
    return [o.outputs[0] for o in llm.chat(CHATS, params, use_tqdm=False)]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=60, logprobs=2),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=60, logprobs=1),
    SamplingParams(temperature=0, max_tokens=60, stop=["fig"], include_stop_str_in_output=True),
], ids=["greedy", "seeded", "stop-string"])
def test_smollm2_output_is_unchanged_by_drafts(smol_pair, params):
    plain, spec = smol_pair
    before = spec.llm_engine.core.stats()
    ours, reference = _run(spec, params), _run(plain, params)
    for a, b in zip(ours, reference):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        if params.logprobs:
            assert [list(lp) for lp in a.logprobs] == [list(lp) for lp in b.logprobs]
            assert torch.allclose(torch.tensor([lp[t].logprob for t, lp in zip(a.token_ids, a.logprobs)]),
                                  torch.tensor([lp[t].logprob for t, lp in zip(b.token_ids, b.logprobs)]), atol=1e-4)
    after = spec.llm_engine.core.stats()
    assert after.spec_decode_num_accepted_tokens > before.spec_decode_num_accepted_tokens
    assert after.spec_decode_num_draft_tokens >= after.spec_decode_num_accepted_tokens
    assert spec.llm_engine.core.async_scheduling is False and plain.llm_engine.core.async_scheduling is True
    assert spec.llm_engine.core.scheduler.kv_cache_manager.num_free_blocks == spec.llm_engine.core.num_blocks


@pytest.mark.parametrize("stop, min_tokens, kept", [(" ab ab", 0, 2), (" ab", 5, 6)])
def test_a_stop_string_inside_a_step_of_drafts_ends_the_output_there(tmp_path_factory, smollm2_path, stop,
                                                                    min_tokens, kept):
    """Every token is " ab" (allowed_token_ids), so every draft is kept and a step brings up to five tokens: the
    output still ends at the token that completed the stop string, logprobs included, as without drafts."""
    from test_server import tiny_model_with_smollm2_vocab

    model = tiny_model_with_smollm2_vocab(tmp_path_factory)
    for extra in ({}, {"speculative_config": SPEC}):
        llm = LLM(model, tokenizer=smollm2_path, num_kv_blocks=64, **extra)
        ab = llm.get_tokenizer().encode(" ab", add_special_tokens=False)[0]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, allowed_token_ids=[ab], stop=[stop],
                                min_tokens=min_tokens, logprobs=0)
        out = llm.generate([[ab] * 12], params, use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, len(out.logprobs), out.finish_reason, out.stop_reason) == (
            [ab] * kept, kept, "stop", stop)
    assert llm.llm_engine.core.scheduler.spec_stats.num_accepted_tokens > 0


def test_drafts_are_not_proposed_where_the_host_decides_each_token(smol_pair):
    """Penalties (device-side counts) and grammars (a matcher per token) sample their rows one position at a
    time: such requests decode without drafts beside ones that use them, with the same output."""
    plain, spec = smol_pair
    params = [SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=40),
              SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": "(fig, ){2,6}fig"})]
    ours = [o.outputs[0].token_ids for o in spec.chat(CHATS, params, use_tqdm=False)]
    assert ours == [o.outputs[0].token_ids for o in plain.chat(CHATS, params, use_tqdm=False)]


def tiny_prompts() -> list[list[int]]:
    shared = [(11 * j + 5) % 256 for j in range(24)]
    return [shared + [(13 * i + j) % 256 for j in range(3 + 4 * i)] for i in range(8)]


@pytest.mark.parametrize("max_num_seqs", [256, 3], ids=["decode-rows", "few-seqs"])
def test_tiny_model_under_preemption_chunking_prefix_hits_and_n(tiny_models, max_num_seqs):
    """A small pool and budget preempt and chunk; two samples per prompt share its blocks; eos and stop token ids
    end requests mid-step. With max_num_seqs 3 a step's drafts and decodes outnumber the decode graphs' rows, so
    attention takes them as sequences of several tokens (as beside a prefill) instead of a row per token."""
    kwargs = dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=16, max_num_seqs=max_num_seqs)
    params = [SamplingParams(temperature=0, max_tokens=100, n=2),
              SamplingParams(temperature=1.0, seed=3, max_tokens=40, n=2),
              SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[7, 100, 200]),
              SamplingParams(temperature=0, max_tokens=100, min_tokens=5)] * 2
    plain = LLM(tiny_models["llama"], **kwargs).generate(tiny_prompts()[: len(params)], params, use_tqdm=False)
    spec_llm = LLM(tiny_models["llama"], speculative_config=SPEC, **kwargs)
    for _ in range(2):  # the second run hits the prefix cache
        ours = spec_llm.generate(tiny_prompts()[: len(params)], params, use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in ours] == [[c.token_ids for c in o.outputs] for o in plain]
        assert [[c.finish_reason for c in o.outputs] for o in ours] == \
            [[c.finish_reason for c in o.outputs] for o in plain]
    core = spec_llm.llm_engine.core
    assert core.scheduler.num_preemptions > 0 and core.scheduler.kv_cache_manager.prefix_hits > 0
    assert {c.finish_reason for o in ours for c in o.outputs} == {"stop", "length"}
    assert core.stats().spec_decode_num_accepted_tokens > 0
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.num_blocks


def test_server_with_drafts_answers_as_offline_and_counts_them(smol_pair, smollm2_path, tmp_path):
    """`nanoinfer serve --speculative-config JSON`: streamed and whole replies equal the offline engine's without
    drafts, and /metrics counts the drafts checked and kept under vLLM's names."""
    import json

    import openai
    from test_server import launch_server, metric_values

    server = launch_server(str(tmp_path / "server.log"), smollm2_path, "--speculative-config", json.dumps(SPEC))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        reference = _run(smol_pair[0], SamplingParams(temperature=0, max_tokens=60))
        model = client.models.list().data[0].id
        for messages, expected in zip(CHATS, reference):
            reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=60)
            assert reply.choices[0].message.content == expected.text
            assert reply.usage.completion_tokens == len(expected.token_ids)
            chunks = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=60,
                                                    stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
        metrics = metric_values(server.url)
        accepted = metrics[("nanoinfer:spec_decode_num_accepted_tokens_total", ())]
        assert 0 < accepted <= metrics[("nanoinfer:spec_decode_num_draft_tokens_total", ())]
        assert metrics[("nanoinfer:spec_decode_num_drafts_total", ())] > 0
        per_pos = {labels: v for (name, labels), v in metrics.items()
                   if name == "nanoinfer:spec_decode_num_accepted_tokens_per_pos_total"}
        assert sum(per_pos.values()) == accepted and (("position", "0"),) in per_pos
    finally:
        assert server.stop() == 0, server.log()


def test_a_step_of_drafts_and_decodes_is_a_decode_step_of_a_row_per_token(tiny_models, monkeypatch):
    """Attention sees each drafted position as a one-token sequence whose context ends at it (what the decode
    kernels and graphs take); a step that also prefills keeps a sequence per request."""
    from nanoinfer.model_runner.model_runner import ModelRunner

    seen = []
    prepare = ModelRunner._prepare_inputs

    def spy(self, scheduler_output):
        inputs = prepare(self, scheduler_output)
        seen.append((dict(scheduler_output.num_scheduled_tokens), dict(scheduler_output.scheduled_spec_tokens),
                     inputs))
        return inputs

    monkeypatch.setattr(ModelRunner, "_prepare_inputs", spy)
    llm = LLM(tiny_models["llama"], block_size=4, num_kv_blocks=64, speculative_config=SPEC)
    llm.generate([p * 2 for p in tiny_prompts()[:3]], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    drafted = [(n, spec, inputs) for n, spec, inputs in seen if spec]
    assert sum(inputs.metadata.is_decode_only for _, _, inputs in drafted) > 0
    for scheduled, spec, inputs in drafted:
        metadata, tokens = inputs.metadata, sum(scheduled.values())
        if all(count == 1 + len(spec.get(r, ())) for r, count in scheduled.items()):
            assert metadata.is_decode_only and metadata.num_seqs == tokens
            assert metadata.seq_lens.tolist() == (inputs.positions + 1).tolist()
        else:
            assert metadata.num_seqs == len(scheduled)
        assert inputs.query_start_loc[-1] == tokens and len(inputs.query_start_loc) == len(scheduled) + 1


def test_metrics_count_kept_drafts_by_position_and_log_the_acceptance():
    """The server's view of the core's counts: a counter per draft position (vLLM's
    spec_decode_num_accepted_tokens_per_pos), and the periodic log line's acceptance over its interval."""
    from nanoinfer.engine.core import SchedulerStats
    from nanoinfer.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    stats = SchedulerStats(1, 0, 0.5, 0, 0, 0, spec_decode_num_drafts=4, spec_decode_num_draft_tokens=12,
                           spec_decode_num_accepted_tokens=6, spec_decode_num_accepted_tokens_per_pos=[3, 2, 1])
    metrics.on_core_stats(dataclasses.asdict(stats), 10)
    assert "draft acceptance rate: 50.0%, mean acceptance length: 2.50" in metrics.log_line()
    stats.spec_decode_num_accepted_tokens_per_pos = [4, 2, 1, 1]
    metrics.on_core_stats(dataclasses.asdict(stats), 10)
    text = metrics.render().decode()
    for position, total in enumerate([4, 2, 1, 1]):
        assert f'spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{position}"}} {total}.0' in text
    assert "draft acceptance" not in metrics.log_line()  # no drafts since the last line
