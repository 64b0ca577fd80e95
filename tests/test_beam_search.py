"""Beam search (vLLM's algorithm, outside the engine): width 1 is greedy; one step keeps the most likely tokens;
each beam's cumulative logprob is its tokens' logprobs under transformers; end-of-sequence completes a beam."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoinfer import LLM, BeamSearchParams, SamplingParams

PROMPTS = [[5, 17, 42, 7], [100, 3, 9, 9, 250, 11]]


@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    return LLM(tiny_models["qwen3"], device="cpu")


@pytest.fixture(scope="module")
def hf(tiny_models):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=torch.float32).eval()


def hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """Each position's log-softmax over the vocabulary, for the next token."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float().log_softmax(dim=-1)


def test_width_one_is_greedy(llm):
    greedy = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                          SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    beams = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                            BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True))
    for prompt, g, b in zip(PROMPTS, greedy, beams):
        assert [s.tokens for s in b.sequences] == [prompt + g.outputs[0].token_ids]


def test_one_step_keeps_the_most_likely_tokens(llm, hf):
    out = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=4, max_tokens=1, ignore_eos=True))[0]
    expected = hf_logprobs(hf, PROMPTS[0])[-1].topk(4)
    assert [s.tokens[-1] for s in out.sequences] == expected.indices.tolist()
    assert [s.cum_logprob for s in out.sequences] == pytest.approx(expected.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_beams_are_scored_by_their_models_logprobs(llm, hf, length_penalty):
    params = BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True, length_penalty=length_penalty)
    for prompt, out in zip(PROMPTS, llm.beam_search(PROMPTS, params)):
        sequences = out.sequences
        assert len(sequences) == 3 and len({tuple(s.tokens) for s in sequences}) == 3
        for s in sequences:
            assert s.tokens[: len(prompt)] == prompt and len(s.tokens) == len(prompt) + 4 and s.finish_reason == "length"
            table = hf_logprobs(hf, s.tokens)
            chosen = sum(table[i - 1, s.tokens[i]].item() for i in range(len(prompt), len(s.tokens)))
            assert s.cum_logprob == pytest.approx(chosen, abs=1e-4)
            assert len(s.logprobs) == 4 and all(s.tokens[len(prompt) + i] in lp for i, lp in enumerate(s.logprobs))
        scores = [s.cum_logprob / len(s.tokens) ** length_penalty for s in sequences]
        assert scores == sorted(scores, reverse=True)


def test_end_of_sequence_completes_a_beam(tiny_models, tmp_path):
    """The tiny model's most likely first token made its end-of-sequence token: the best beam stops there."""
    first = LLM(tiny_models["qwen3"], device="cpu").beam_search(
        [PROMPTS[0]], BeamSearchParams(beam_width=1, max_tokens=1, ignore_eos=True))[0].sequences[0].tokens[-1]
    folder = tmp_path / "model"
    shutil.copytree(tiny_models["qwen3"], folder)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps(config | {"eos_token_id": first}))
    llm = LLM(str(folder), device="cpu")
    out = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=3))[0].sequences
    stopped = [s for s in out if s.finish_reason == "stop"]
    assert stopped and all(s.tokens[-1] == first and len(s.tokens) == len(PROMPTS[0]) + 1 for s in stopped)
    assert all(s.finish_reason == "length" for s in llm.beam_search(
        [PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))[0].sequences)


def test_bad_beam_search_params_are_clear_errors(llm):
    for bad, match in (({"beam_width": 0, "max_tokens": 4}, "beam_width must be an integer >= 1"),
                       ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
                       ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty"),
                       ({"beam_width": 2, "max_tokens": 4, "temperature": -1.0}, "temperature")):
        with pytest.raises(ValueError, match=match):
            BeamSearchParams(**bad)
    with pytest.raises(TypeError, match="params must be BeamSearchParams"):
        llm.beam_search(PROMPTS, SamplingParams())
    # Each step asks for 2 x beam_width logprobs: the engine's max_logprobs (20 by default) bounds the width.
    with pytest.raises(ValueError, match=r"beam_width 11 asks for 22 logprobs per step, more than the engine's "
                                         r"max_logprobs \(20\): at most 10"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match=r"beam_width 2361183241434822606848 asks for"):  # named, not "logprobs"
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2**71, max_tokens=2))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.beam_search([[10**6]], BeamSearchParams(beam_width=2, max_tokens=2))


def test_a_prompts_cache_salt_holds_for_every_step(llm, monkeypatch):
    """A salted prompt's steps read only that tenant's cached prefix, none of another's (vLLM's isolation)."""
    kv = llm.llm_engine.core.scheduler.kv_cache_manager
    prompt = list(range(3, 43))  # more than one block
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    before = kv.prefix_hits
    llm.beam_search([{"prompt_token_ids": prompt, "cache_salt": "tenant"}], BeamSearchParams(beam_width=2, max_tokens=1))
    assert kv.prefix_hits == before  # the unsalted warm prefix is another tenant's
    salts, add_request = [], llm.llm_engine.add_request
    monkeypatch.setattr(llm.llm_engine, "add_request", lambda *args, **kwargs: (salts.append(args[1]["cache_salt"]),
                                                                            add_request(*args, **kwargs))[1])
    llm.beam_search([{"prompt_token_ids": prompt, "cache_salt": "tenant"}, prompt],
                    BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    assert salts == ["tenant", None] + ["tenant", "tenant", None, None] * 2  # each step's beams, search by search


def test_beams_that_could_never_queue_are_refused_before_any_step(tiny_models, monkeypatch):
    llm = LLM(tiny_models["qwen3"], device="cpu", max_num_waiting=3)
    monkeypatch.setattr(llm, "generate", lambda *args, **kwargs: pytest.fail("a step ran"))
    with pytest.raises(ValueError, match=r"needs 4 places in the waiting queue \(n or beams x prompts\)"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=3))


@pytest.mark.parametrize("length_penalty", [2000.0, -2000.0, 1e308])
def test_extreme_length_penalties_rank_without_overflow(llm, length_penalty):
    """length ** length_penalty overflows a float here: the beams are still ranked (in log space)."""
    out = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=length_penalty))
    assert [len(o.sequences) for o in out] == [2] * len(PROMPTS)


@settings(max_examples=200, deadline=None)
@given(width=st.integers(1, 4), steps=st.integers(1, 5), eos=st.sets(st.integers(0, 9), max_size=2),
       length_penalty=st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.5, 300.0, -300.0]), seed=st.integers(0, 2**16))
def test_beam_search_state_keeps_its_invariants(width, steps, eos, length_penalty, seed):
    """Whatever each step's candidates: at most `width` live beams, each extending a beam of the step before by
    one token; completed beams end with an end-of-sequence token; the result is the `width` best by score, best
    first, each's cumulative logprob the sum of its chosen tokens' logprobs."""
    import random

    from nanoinfer.engine.beam_search import BeamSearch
    from nanoinfer.outputs import Logprob

    rng = random.Random(seed)
    params = BeamSearchParams(beam_width=width, max_tokens=steps, length_penalty=length_penalty)
    search = BeamSearch([1, 2, 3], params, eos)
    while search.beams:
        before = {tuple(b.tokens) for b in search.beams}
        search.advance([{t: Logprob(-rng.random() * 5) for t in rng.sample(range(10), 2 * width)}
                        for _ in search.beams])
        assert len(search.beams) <= width and all(tuple(b.tokens[:-1]) in before for b in search.beams)
        assert not any(b.tokens[-1] in eos for b in search.beams)
    best = search.best()
    assert 1 <= len(best) <= width
    scores = [b.cum_logprob / (len(b.tokens) - (b.tokens[-1] in eos)) ** length_penalty for b in best]
    assert scores == sorted(scores, reverse=True)
    for b in best:
        assert b.finish_reason == ("stop" if b.tokens[-1] in eos else "length")
        assert len(b.tokens) - 3 == len(b.logprobs) <= steps
        assert b.cum_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(b.tokens[3:], b.logprobs)))
