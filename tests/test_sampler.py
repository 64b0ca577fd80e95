"""Sampler checks against direct per-row computations in float64 Python/torch."""

import dataclasses
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from nanoinfer.sample.sampler import (
    Sampler,
    SamplingMetadata,
    apply_filters,
    apply_penalties,
    apply_top_k,
    apply_top_k_top_p,
)
from nanoinfer.sample.penalties import PenaltyState
from nanoinfer.sampling_params import SamplingParams

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
EOS = 0


def build(params, vocab_size, device="cpu", prompts=None, outputs=None, generators=None, stops=None, bad=None):
    """Metadata for rows whose requests have these prompt and output tokens (penalized rows get slots)."""
    rows = len(params)
    prompts, outputs = prompts or [[] for _ in range(rows)], outputs or [[] for _ in range(rows)]
    state = PenaltyState(rows, vocab_size, torch.device(device))
    slots = [state.open(pr, o) if p.uses_penalties else None for p, pr, o in zip(params, prompts, outputs)]
    return SamplingMetadata.build(
        params=params,
        num_output_tokens=[len(o) for o in outputs],
        generators=generators or [None] * rows,
        stop_token_ids=stops or [{EOS} for _ in range(rows)],
        vocab_size=vocab_size,
        device=torch.device(device),
        penalties=(state, slots),
        bad_word_ids=bad,
    )


def seeded(seed, device="cpu"):
    return torch.Generator(device=device).manual_seed(seed)


def allowed_tokens(logits: list[float], p: SamplingParams, slack: float = 0.0) -> set[int]:
    """The filtered support of one row, computed directly (float64, plain Python).

    `slack` widens the top-p cut so rounding at the boundary cannot flip a token.
    """
    scaled = [x / p.temperature for x in logits]
    top = max(scaled)  # min-p first, as vLLM: against the most likely token's probability
    order = [i for i in sorted(range(len(scaled)), key=lambda i: -scaled[i])
             if math.exp(scaled[i] - top) >= p.min_p * (1 - slack)]
    keep = order[: p.top_k] if p.top_k > 0 else order
    if p.top_p < 1:
        top = max(scaled[i] for i in keep)
        weights = {i: math.exp(scaled[i] - top) for i in keep}
        total = sum(weights.values())
        mass_above, kept = 0.0, []
        for i in keep:
            if mass_above >= p.top_p + slack:
                break
            kept.append(i)
            mass_above += weights[i] / total
        keep = kept
    return set(keep)


logits_rows = st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=12, max_size=12, unique=True)
filter_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.3, 0.7, 1.0, 1.5]),
    top_k=st.integers(0, 14),
    top_p=st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.2, 0.01]),
    min_p=st.sampled_from([0.0, 0.05, 0.3, 0.9]),
)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device):
    logits = torch.randn(6, 50, generator=seeded(0)).to(device)
    # Filters on a greedy row change nothing and must not force a sort.
    params = [SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.5)] * 6
    metadata = build(params, 50, device)
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(logits_rows, filter_params), min_size=1, max_size=4), seed=st.integers(0, 2**32))
def test_filters_never_leave_the_allowed_set(rows, seed):
    params = [p for _, p in rows]
    repeats = 64  # each row many times in one batch: many independent draws
    logits = torch.tensor([row for row, _ in rows for _ in range(repeats)])
    torch.manual_seed(seed)
    out = Sampler()(logits, build([p for p in params for _ in range(repeats)], 12))
    for i, (row, p) in enumerate(rows):
        sampled = set(out.sampled_token_ids[i * repeats : (i + 1) * repeats].tolist())
        assert sampled <= allowed_tokens(row, p, slack=1e-4), (p, sampled)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(logits_rows, filter_params), min_size=1, max_size=4))
def test_filter_functions_keep_exactly_the_allowed_set(rows):
    """The filters in isolation (top-k alone takes the no-sort path)."""
    params = [p for _, p in rows]
    for row, p in rows:
        assume(allowed_tokens(row, p, slack=1e-4) == allowed_tokens(row, p, slack=-1e-4))
    metadata = build(params, 12)
    logits = apply_filters(torch.tensor([row for row, _ in rows]), metadata)
    for i, (row, p) in enumerate(rows):
        kept = set(torch.isfinite(logits[i]).nonzero().flatten().tolist())
        assert kept == allowed_tokens(row, p), p


def test_min_p_filters_before_top_p():
    """vLLM's order: min-p drops the tail first, then top-p reads the mass of what is left (here token 1 holds
    0.286 of it, past top_p 0.7's cut); the other order would keep token 1 in 29% of draws."""
    probs = torch.tensor([0.5, 0.2] + [0.3 / 38] * 38)
    params = [SamplingParams(top_p=0.7, min_p=0.1)]
    kept = torch.isfinite(apply_filters(probs.log()[None], build(params, 40))).nonzero()[:, 1].tolist()
    assert kept == [0]


def test_top_k_paths_agree():
    logits = torch.randn(5, 40, generator=seeded(1))
    top_k = torch.tensor([1, 7, 40, 3, 40])
    no_sort = apply_top_k(logits, top_k, max_top_k=7)
    with_sort = apply_top_k_top_p(logits, top_k, torch.ones(5))
    assert torch.equal(no_sort, with_sort)
    assert torch.isfinite(no_sort).sum(-1).tolist() == [1, 7, 40, 3, 40]


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_repeat_whatever_the_batch(device):
    vocab = 300
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    logits = torch.randn(8, vocab, generator=seeded(2)).to(device)

    def run(batch_params, target_row, steps=4):
        generators = [seeded(p.seed, device) if p.seed is not None else None for p in batch_params]
        tokens = []
        for _ in range(steps):  # the generator advances from step to step
            metadata = build(batch_params, vocab, device, generators=generators)
            tokens.append(Sampler()(logits[: len(batch_params)], metadata).sampled_token_ids[target_row].item())
        return tokens

    alone = run([target], 0)
    assert alone == run([target], 0)
    others = [SamplingParams(temperature=0.0), SamplingParams(top_k=5, seed=7), SamplingParams(min_p=0.1)]
    logits[:4] = logits[0]  # same logits row for the target wherever it sits
    assert run(others + [target], 3) == alone
    assert run([SamplingParams(temperature=1.3), target, SamplingParams(presence_penalty=1.0)], 1) == alone
    assert len(set(run([SamplingParams(temperature=5.0, seed=s) for s in range(8)], 0, steps=8))) > 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=0.7)],
                         ids=["top_p", "temperature_only"])  # the general path, and the fused one
def test_distribution_matches_direct_computation(device, p):
    """Empirical frequencies at temperature 0.7 (with and without top_p 0.9) vs the exact distribution (chi-square)."""
    logits_row = [2.0, 1.5, 1.2, 1.0, 0.3, -0.5, -1.0, -3.0]
    support = sorted(allowed_tokens(logits_row, p))
    weights = [math.exp(logits_row[i] / p.temperature) for i in support]
    expected = {i: w / sum(weights) for i, w in zip(support, weights)}
    draws = 40_000
    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.manual_seed(0)
    logits = torch.tensor([logits_row] * draws, device=device)
    counts = torch.bincount(Sampler()(logits, build([p] * draws, 8, device)).sampled_token_ids.cpu(), minlength=8)
    assert set(counts.nonzero().flatten().tolist()) == set(support)
    chi2 = sum((counts[i].item() - draws * q) ** 2 / (draws * q) for i, q in expected.items())
    assert chi2 < 25.0, (chi2, counts, expected)  # p ~ 3e-4 for the 4-5 degrees of freedom here


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", [
    [SamplingParams(temperature=0)] * 3,  # argmax
    [SamplingParams(temperature=0.8)] * 3,  # the fused temperature sampler
    [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0), SamplingParams(temperature=1.0)],
    [SamplingParams(temperature=0.8, presence_penalty=0.5, logprobs=2)] * 3,  # upcast first
], ids=["greedy", "temperature", "filters", "penalties_logprobs"])
def test_bf16_logits_sample_as_their_float32_copy(device, params):
    """Logits in the model's dtype (bf16) sample exactly as their float32 copy, draw for draw, on
    every path (the sampler's math is float32 whatever the logits' dtype)."""
    torch.manual_seed(1)
    logits = (torch.randn(3, 1000) * 3).to(device=device, dtype=torch.bfloat16)
    outputs = [[5, 6, 7]] * 3
    results = []
    for x in (logits, logits.float()):
        torch.manual_seed(0)
        if device == "cuda":
            torch.cuda.manual_seed(0)
        results.append(Sampler()(x, build(params, 1000, device, outputs=outputs)))
    assert torch.equal(results[0].sampled_token_ids, results[1].sampled_token_ids)
    if results[0].logprobs is not None:
        assert torch.equal(results[0].logprobs.logprobs, results[1].logprobs.logprobs)


def direct_penalties(row, prompt, output, p):
    seen = set(prompt) | set(output)
    out = []
    for token, x in enumerate(row):
        if token in seen:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        count = output.count(token)
        out.append(x - p.frequency_penalty * count - p.presence_penalty * (count > 0))
    return out


penalty_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 1.0]),
    repetition_penalty=st.sampled_from([1.0, 0.5, 1.3, 2.0]),
    presence_penalty=st.sampled_from([0.0, -1.0, 0.7, 2.0]),
    frequency_penalty=st.sampled_from([0.0, -0.5, 0.4, 2.0]),
)
token_lists = st.lists(st.integers(0, 15), max_size=10)


@settings(max_examples=80, deadline=None)
@given(rows=st.lists(st.tuples(logits_rows.map(lambda r: r + [0.0] * 4), penalty_params, token_lists, token_lists),
                     min_size=1, max_size=4))
def test_penalties_match_direct_computation(rows):
    metadata = build([p for _, p, _, _ in rows], 16, prompts=[pr for *_, pr, _ in rows], outputs=[o for *_, o in rows])
    logits = torch.tensor([row for row, *_ in rows])
    penalised = apply_penalties(logits, metadata)
    expected = torch.tensor([direct_penalties(row, pr, o, p) for row, p, pr, o in rows])
    torch.testing.assert_close(penalised, expected)
    # Greedy rows pick the argmax of the penalised logits.
    sampled = Sampler()(logits, metadata).sampled_token_ids
    for i, (_, p, _, _) in enumerate(rows):
        if p.is_greedy:
            assert penalised[i, sampled[i]] == penalised[i].max()


def test_penalty_tensors_only_when_used():
    plain = build([SamplingParams(), SamplingParams(temperature=0)], 10, prompts=[[1, 2], [3]], outputs=[[4], [5]])
    assert plain.counted is None and plain.penalty_state is None
    mixed = build([SamplingParams(presence_penalty=0.5), SamplingParams()], 10, prompts=[[1, 2], [3, 3, 3]],
                  outputs=[[4], [5, 6]])
    assert mixed.repetition_penalties is None
    rows, slots = mixed.counted
    assert rows.tolist() == [0] and slots.tolist() == [0]  # only the penalized row is read and counted
    assert mixed.penalty_state.output_counts[0].nonzero().flatten().tolist() == [4]
    logits = torch.zeros(2, 10)
    assert apply_penalties(logits, mixed)[1].tolist() == [0.0] * 10  # the other row untouched


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_tokens_are_counted_on_the_device(device):
    """Each step's sampled token is added to its row's slot by the sampler, so the next step's penalties see it
    without the host sending the history again; slots are reused clean."""
    params = [SamplingParams(temperature=0, frequency_penalty=2.0), SamplingParams(temperature=0)]
    metadata = build(params, 8, device, prompts=[[1], [1]], outputs=[[], []])
    logits = torch.tensor([[0, 0, 0, 5.0, 4.0, 0, 0, 0]] * 2, device=device)
    picks = [Sampler()(logits, metadata).sampled_token_ids.tolist() for _ in range(3)]
    # Row 0 loses 2.0 per earlier pick of a token: 3, then 4 (5 - 2 < 4), then 3 again (5 - 2 > 4 - 2).
    assert [p[0] for p in picks] == [3, 4, 3] and [p[1] for p in picks] == [3, 3, 3]
    state, slot = metadata.penalty_state, metadata.counted[1][0].item()
    assert state.output_counts[slot, 3].item() == 2 and state.output_counts[slot, 4].item() == 1
    assert int(state.output_counts.sum()) == 3  # unpenalized rows are never counted
    state.close(slot)
    assert state.open([2], [5]) == slot and state.output_counts[slot].nonzero().flatten().tolist() == [5]
    assert state.prompt_seen[slot].nonzero().flatten().tolist() == [2]


@pytest.mark.parametrize("device", DEVICES)
def test_min_tokens_blocks_stop_tokens(device):
    logits = torch.zeros(4, 10, device=device)
    logits[:, EOS] = 100.0
    logits[:, 7] = 100.0  # a stop_token_id
    logits[:, 3] = 5.0
    params = [SamplingParams(temperature=0, min_tokens=3), SamplingParams(min_tokens=3),
              SamplingParams(temperature=0, min_tokens=3), SamplingParams(temperature=0)]
    outputs = [[1, 2], [1, 2], [1, 2, 3], []]
    metadata = build(params, 10, device, outputs=outputs, stops=[{EOS, 7}] * 4)
    sampled = Sampler()(logits, metadata).sampled_token_ids.tolist()
    assert sampled[0] == 3 and sampled[1] not in (EOS, 7)
    assert sampled[2] in (EOS, 7) and sampled[3] in (EOS, 7)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_words_ban_beside_min_tokens(device):
    """The tokens a row's bad words ban this step are masked, with its min_tokens stop tokens where it has both."""
    logits = torch.zeros(3, 10, device=device)
    logits[:, 4], logits[:, EOS], logits[:, 6] = 9.0, 8.0, 7.0
    params = [SamplingParams(temperature=0, min_tokens=5), SamplingParams(temperature=0), SamplingParams(temperature=0)]
    metadata = build(params, 10, device, outputs=[[1], [1], [1]], bad=[{4}, {4, 6}, set()])
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [6, EOS, 4]
    with pytest.raises(ValueError, match="banned token id 10 is outside the vocabulary"):
        build(params[:1], 10, device, bad=[{10}])


@pytest.mark.parametrize("device", DEVICES)
def test_a_grammars_mask_is_applied_before_the_logprobs(device):
    """As vLLM's runner applies the grammar's bitmask before its sampler: the logprobs are over what the grammar
    allows (unlike logit_bias or allowed_token_ids, which leave the model's own)."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]], device=device)
    metadata = build([SamplingParams(temperature=0, logprobs=2)], 5, device)
    bitmask = torch.tensor([[0b10110]], dtype=torch.int32)  # tokens 1, 2 and 4
    metadata = dataclasses.replace(metadata, allowed_tokens=(torch.tensor([0], device=device), bitmask.to(device)))
    out = Sampler()(logits, metadata)
    assert out.sampled_token_ids.tolist() == [1]
    expected = torch.tensor([3.0, 2.0, 0.0]).log_softmax(-1)
    assert out.logprobs.logprob_token_ids[0].tolist() == [1, 1, 2]  # the sampled token, then the top 2
    assert out.logprobs.logprobs[0].cpu() == pytest.approx(expected[[0, 0, 1]])


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_moves_the_choice_not_the_logprobs(device):
    logits = torch.zeros(3, 10, device=device)
    logits[:, 2] = 5.0
    params = [SamplingParams(temperature=0, logit_bias={2: -10.0, 6: 1.0}),  # 6 now leads (1 vs -5)
              SamplingParams(temperature=1.0, logit_bias={8: 100.0}, logprobs=1),
              SamplingParams(temperature=0)]
    out = Sampler()(logits, build(params, 10, device))
    assert out.sampled_token_ids.tolist() == [6, 8, 2]
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert torch.allclose(out.logprobs.logprobs[1, 0], raw[1, 8])  # logprobs are the model's own
    with pytest.raises(ValueError, match="logit_bias token id 10 is outside the vocabulary"):
        build([SamplingParams(logit_bias={10: 1.0})], 10, device)


@pytest.mark.parametrize("device", DEVICES)
def test_allowed_token_ids_restrict_the_choice_not_the_logprobs(device):
    """Only a row's allowed ids can be sampled, greedy or random, whatever else biases them; other rows and the
    logprobs (the model's own) are untouched."""
    logits = torch.randn(4, 50, generator=seeded(7)).to(device)
    logits[:, 3] = 20.0  # the best token everywhere, allowed in no limited row
    params = [SamplingParams(temperature=0, allowed_token_ids=[10, 11, 12], logprobs=1),
              SamplingParams(temperature=1.0, allowed_token_ids=[40, 41], logit_bias={3: 5.0}),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0.7, top_k=5, allowed_token_ids=[7])]
    for _ in range(20):
        out = Sampler()(logits, build(params, 50, device))
        tokens = out.sampled_token_ids.tolist()
        assert tokens[0] == 10 + int(logits[0, 10:13].argmax()) and tokens[1] in (40, 41) and tokens[2] == 3
        assert tokens[3] == 7
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert torch.allclose(out.logprobs.logprobs[0, 0], raw[0, tokens[0]])
    with pytest.raises(ValueError, match="allowed_token_ids entry 50 is outside the vocabulary"):
        build([SamplingParams(allowed_token_ids=[1, 50])], 50, device)
    with pytest.raises(ValueError, match="allowed_token_ids is empty"):
        SamplingParams(allowed_token_ids=[])


@pytest.mark.parametrize("bias, error, match", [
    ([1, 2], TypeError, "logit_bias must be a dict"),
    ({"5": 1.0}, TypeError, "logit_bias key must be"),
    ({-1: 1.0}, ValueError, "logit_bias keys must be token ids >= 0"),
    ({5: 100.5}, ValueError, r"logit_bias values must be in \[-100, 100\]"),
    ({5: float("nan")}, ValueError, "logit_bias value must be finite"),
    (dict.fromkeys(range(1025), 1.0), ValueError, "at most 1024"),
])
def test_bad_logit_bias(bias, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(logit_bias=bias)


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax(device):
    vocab = 64
    logits = torch.randn(4, vocab, generator=seeded(3)).to(device)
    params = [SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.5), SamplingParams(logprobs=0),
              SamplingParams(temperature=0), SamplingParams(logprobs=2, top_k=3, seed=9)]
    metadata = build(params, vocab, device, prompts=[[1, 2, 3]] * 4, generators=[None, None, None, seeded(9, device)])
    out = Sampler()(logits, metadata)
    lp = out.logprobs
    assert lp.logprobs.shape == lp.logprob_token_ids.shape == (4, 6)
    raw = torch.log_softmax(logits.double(), dim=-1)
    sampled = out.sampled_token_ids
    assert torch.equal(lp.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(lp.logprobs.double(), raw.gather(1, lp.logprob_token_ids))
    top = lp.logprobs[:, 1:]
    assert torch.all(top[:, :-1] >= top[:, 1:])
    assert torch.equal(lp.logprob_token_ids[:, 1:], raw.topk(5, dim=-1).indices)
    expected_ranks = (raw > raw.gather(1, sampled[:, None])).sum(-1) + 1
    assert torch.equal(lp.selected_token_ranks, expected_ranks)
    assert lp.selected_token_ranks[2] == 1  # greedy


def test_bad_inputs():
    metadata = build([SamplingParams()] * 2, 10)
    with pytest.raises(ValueError, match="logits must have shape"):
        Sampler()(torch.zeros(2, 11), metadata)
    with pytest.raises(ValueError, match="generators"):
        SamplingMetadata.build([SamplingParams()], [0], [], [set()], 10, torch.device("cpu"))
    with pytest.raises(ValueError, match="need a slot of a PenaltyState"):
        SamplingMetadata.build([SamplingParams(presence_penalty=1.0)], [0], [None], [set()], 10, torch.device("cpu"))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        build([SamplingParams(min_tokens=2)], 10, stops=[{12}])
    with pytest.raises(ValueError, match="at least one row"):
        build([], 10)
