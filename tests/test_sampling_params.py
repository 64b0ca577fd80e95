import math
import subprocess
import sys

import pytest

import nanoinfer.sampling_params as sampling_params_module
from nanoinfer.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.stop, p.stop_token_ids, p.include_stop_str_in_output, p.ignore_eos) == ([], [], False, False)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.skip_special_tokens) == (16, 0, None, True)
    assert not p.is_greedy


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=(5, 7), top_k=-1, temperature=1, max_tokens=None)
    assert p.stop == ["###"] and p.stop_token_ids == [5, 7] and p.top_k == 0
    assert isinstance(p.temperature, float) and p.max_tokens is None
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]


def test_vllm_readings_of_special_values():
    """As vLLM's SamplingParams: seed -1 is unseeded, logprobs / prompt_logprobs True is 1 and False 0 (the chosen
    token's logprob only), -1 the whole vocabulary (resolved at admission, under the engine's max_logprobs)."""
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    for name in ("logprobs", "prompt_logprobs"):
        assert [getattr(SamplingParams(**{name: v}), name) for v in (True, False, -1)] == [1, 0, -1]


def test_clone_is_a_deep_copy():
    p = SamplingParams(stop=["x"], logit_bias={3: 1.0})
    q = p.clone()
    q.stop.append("y")
    q.logit_bias[4] = 2.0
    assert q == SamplingParams(stop=["x", "y"], logit_bias={3: 1.0, 4: 2.0}) and p == SamplingParams(
        stop=["x"], logit_bias={3: 1.0})


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-6, True), (1e-5, False), (0.7, False)])
def test_is_greedy(temperature, greedy):
    assert SamplingParams(temperature=temperature).is_greedy is greedy


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("n", 0, ValueError),
        ("n", 1.0, TypeError),
        ("n", True, TypeError),
        ("temperature", -0.1, ValueError),
        ("temperature", math.nan, ValueError),
        ("temperature", math.inf, ValueError),
        ("temperature", "hot", TypeError),
        ("temperature", None, TypeError),
        ("top_p", 0.0, ValueError),
        ("top_p", 1.01, ValueError),
        ("top_p", math.nan, ValueError),
        ("top_k", -2, ValueError),
        ("top_k", 2.5, TypeError),
        ("min_p", -0.01, ValueError),
        ("min_p", 1.5, ValueError),
        ("seed", "42", TypeError),
        ("seed", 2**64, ValueError),
        ("seed", False, TypeError),
        ("presence_penalty", 2.5, ValueError),
        ("presence_penalty", -2.01, ValueError),
        ("frequency_penalty", 3, ValueError),
        ("frequency_penalty", -math.inf, ValueError),
        ("repetition_penalty", 0.0, ValueError),
        ("repetition_penalty", -1.0, ValueError),
        ("repetition_penalty", math.inf, ValueError),
        ("stop", "", ValueError),
        ("stop", ["ok", ""], ValueError),
        ("stop", ["ok", 3], TypeError),
        ("stop", 3, TypeError),
        ("stop_token_ids", [1, -1], ValueError),
        ("stop_token_ids", [1, "2"], TypeError),
        ("stop_token_ids", 2, TypeError),
        ("include_stop_str_in_output", 1, TypeError),
        ("ignore_eos", "yes", TypeError),
        ("skip_special_tokens", None, TypeError),
        ("max_tokens", 0, ValueError),
        ("max_tokens", 3.0, TypeError),
        ("min_tokens", -1, ValueError),
        ("logprobs", -2, ValueError),
        ("logprobs", 2.0, TypeError),
        ("prompt_logprobs", -2, ValueError),
        ("prompt_logprobs", "1", TypeError),
        ("seed", -1.0, TypeError),
        ("truncate_prompt_tokens", 0, ValueError),
        ("truncate_prompt_tokens", -2, ValueError),
        ("truncate_prompt_tokens", 1.5, TypeError),
        ("allowed_token_ids", [], ValueError),
        ("allowed_token_ids", [1, -1], ValueError),
        ("allowed_token_ids", 5, TypeError),
        ("bad_words", ["ok", ""], ValueError),
        ("bad_words", [3], TypeError),
        ("bad_words", ["w"] * 129, ValueError),
        ("bad_words_token_ids", [[1], []], ValueError),
        ("bad_words_token_ids", [[1, -2]], ValueError),
        ("bad_words_token_ids", 7, ValueError),
    ],
)
def test_bad_values_name_the_field(field, value, error):
    with pytest.raises(error, match=field):
        SamplingParams(**{field: value})


def test_token_id_sets_drop_duplicates_and_words_keep_them():
    params = SamplingParams(stop_token_ids=[3, 3, 4], allowed_token_ids=[5, 5], bad_words_token_ids=[[5, 3, 5], [7, 7]])
    assert params.stop_token_ids == [3, 4] and params.allowed_token_ids == [5]
    assert params.bad_words_token_ids == [[5, 3, 5], [7, 7]]  # a word's tokens, in order


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=5, max_tokens=None).min_tokens == 5


def test_edges_accepted():
    SamplingParams(temperature=0, top_p=1.0, top_k=1, min_p=1.0, presence_penalty=-2, frequency_penalty=2,
                   repetition_penalty=0.01, logprobs=0, seed=-(2**63))
    SamplingParams(logprobs=20, prompt_logprobs=0, seed=2**64 - 1, min_p=0.0)


def test_module_does_not_load_torch():
    """The server validates requests with it before anything heavy loads (the
    module is loaded from its file, so the package __init__ does not count)."""
    code = (
        "import importlib.util, sys;"
        f"spec = importlib.util.spec_from_file_location('sp', {sampling_params_module.__file__!r});"
        "module = sys.modules['sp'] = importlib.util.module_from_spec(spec);"
        "spec.loader.exec_module(module);"
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
