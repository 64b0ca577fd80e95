"""The model's recommended sampling parameters (generation_config.json), as vLLM's `--generation-config auto`
applies them: the defaults of requests that leave those fields unset, offline and over HTTP; 'vllm' ignores them."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from nanoinfer import LLM, SamplingParams
from nanoinfer.server.protocol import ChatCompletionRequest
from test_server import launch_server, tiny_model_with_smollm2_vocab

RECOMMENDED = {"temperature": 0.0, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.05, "max_new_tokens": 5}
DEFAULTS = SamplingParams(temperature=0.0, top_k=20, top_p=0.95, repetition_penalty=1.05, max_tokens=5)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """The servers' tiny Llama, its generation_config.json holding a creator's recommendations (greedy, so the
    outputs can be compared)."""
    path = tmp_path_factory.mktemp("recommended") / "model"
    shutil.copytree(tiny_model_with_smollm2_vocab(tmp_path_factory), path)
    generation = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(generation | RECOMMENDED))
    return str(path)


def test_offline_requests_without_params_take_the_models_defaults(model, smollm2_path):
    llm = LLM(model, tokenizer=smollm2_path, device="cpu")
    assert llm.get_default_sampling_params() == DEFAULTS
    prompts = ["The capital of France is", "One, two,"]
    implicit = [o.outputs[0].token_ids for o in llm.generate(prompts, use_tqdm=False)]
    assert implicit == [o.outputs[0].token_ids for o in llm.generate(prompts, DEFAULTS, use_tqdm=False)]
    assert all(len(ids) == 5 for ids in implicit)
    assert "".join(llm.stream(prompts[0])) == llm.generate(prompts[:1], use_tqdm=False)[0].outputs[0].text
    explicit = SamplingParams(max_tokens=3)  # a SamplingParams given is taken as it is, as in vLLM
    assert len(llm.generate(prompts[:1], explicit, use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_generation_config_vllm_or_another_folder(model, tiny_models, tmp_path):
    assert LLM(model, generation_config="vllm", device="cpu").get_default_sampling_params() == SamplingParams()
    assert LLM(tiny_models["qwen3"], generation_config=model, device="cpu").get_default_sampling_params() == DEFAULTS
    with pytest.raises(FileNotFoundError, match="holds no generation_config.json"):
        LLM(model, generation_config=str(tmp_path), device="cpu")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match=r"bad/generation_config.json: temperature"):
        LLM(model, generation_config=str(bad), device="cpu")
    (bad / "generation_config.json").write_text(json.dumps({"temperature": 0.25, "top_k": None}))
    assert LLM(model, generation_config=str(bad), device="cpu").get_default_sampling_params() == SamplingParams(
        temperature=0.25)  # null: no recommendation, as vLLM reads it


def test_http_fields_left_unset_take_the_models_defaults():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    defaults = {"temperature": 0.0, "top_k": 20, "max_tokens": 5}
    params = request.sampling_params(None, None, defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.0, 20, 5)
    given = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.7, top_k=3)
    params = given.sampling_params(9, None, defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.7, 3, 9)


def test_server_applies_the_models_defaults(model, smollm2_path, tmp_path):
    server = launch_server(str(tmp_path / "server.log"), model, "--tokenizer", smollm2_path)
    try:
        messages = [{"role": "user", "content": "Name a colour."}]
        reply = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages}, timeout=60).json()
        offline = LLM(model, tokenizer=smollm2_path, device="cpu")
        expected = offline.chat(messages, use_tqdm=False)[0].outputs[0]
        assert reply["usage"]["completion_tokens"] == 5 and reply["choices"][0]["message"]["content"] == expected.text
        assert "default sampling parameters from" in server.log()
    finally:
        assert server.stop() == 0


def test_cli_flags_over_the_models_defaults_over_the_clis():
    from nanoinfer.cli import build_parser, sampling_params

    args = build_parser().parse_args(["generate", "hi", "--temperature", "0.5"])
    params = sampling_params(args, {"temperature": 0.0, "top_k": 20})
    assert (params.temperature, params.top_k, params.max_tokens, params.top_p) == (0.5, 20, 256, 1.0)
    assert sampling_params(build_parser().parse_args(["generate", "hi"]), {}).temperature == 0.7
