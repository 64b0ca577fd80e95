"""LoRA adapters over HTTP, as vLLM serves them: `--enable-lora --lora-modules NAME=PATH`, a request's `model`
naming its adapter (on completions and chat, streaming or not, beam search too), /v1/models listing the adapters
with their parent, and /v1/load_lora_adapter + /v1/unload_lora_adapter where VLLM_ALLOW_RUNTIME_LORA_UPDATING
allows them. The reference is the offline LLM with the same adapters (tests/test_lora.py checks that one against
transformers on the merged weights)."""

from __future__ import annotations

import argparse
import json

import httpx
import openai
import pytest

from nanoinfer import LLM, BeamSearchParams, LoRARequest
from test_cli import run
from test_lora import make_adapter
from test_server import KV_BYTES, greedy, launch_server, tiny_model_with_smollm2_vocab

API_KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
NUM_TOKENS = 6


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return tiny_model_with_smollm2_vocab(tmp_path_factory)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, str]:
    """Three adapters: two served from the start, one loaded at run time (rank 8 on q/v only)."""
    root = tmp_path_factory.mktemp("server_lora")
    return {"sql": make_adapter(root / "sql", base, seed=1), "chat": make_adapter(root / "chat", base, seed=2),
            "late": make_adapter(root / "late", base, seed=3, rank=8, modules=("q_proj", "v_proj"))}


@pytest.fixture(scope="module")
def server(base, adapters, smollm2_path, tmp_path_factory):
    """The adapters in both of --lora-modules' forms, and the run-time endpoints on."""
    log = str(tmp_path_factory.mktemp("server_lora_log") / "server.log")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        srv = launch_server(log, base, "--tokenizer", smollm2_path, "--api-key", API_KEY, "--served-model-name",
                            "tiny", "--enable-lora", "--max-loras", "2", "--lora-modules", f"sql={adapters['sql']}",
                            json.dumps({"name": "chat", "path": adapters["chat"], "base_model_name": "tiny"}),
                            "--log-stats-interval", "0")
    yield srv
    assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(base, adapters, smollm2_path):
    """The same model and adapters offline: (the LLM, {model name: its LoRARequest, the base's None})."""
    llm = LLM(base, tokenizer=smollm2_path, kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_loras=2)
    loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}
    return llm, {"tiny": None} | loras


def expected_text(offline, model: str, chat: bool = False) -> str:
    llm, loras = offline
    params = greedy(NUM_TOKENS, ignore_eos=True)
    if chat:
        return llm.chat(MESSAGES, params, use_tqdm=False, lora_request=loras[model])[0].outputs[0].text
    return llm.generate(PROMPT, params, use_tqdm=False, lora_request=loras[model])[0].outputs[0].text


def completion(client, model: str, stream: bool = False) -> str:
    kw = dict(model=model, prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    if stream:
        return "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    out = client.completions.create(**kw)
    assert out.model == model
    return out.choices[0].text


def chat(client, model: str, stream: bool = False) -> str:
    kw = dict(model=model, messages=MESSAGES, max_tokens=NUM_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True))
    out = client.chat.completions.create(**kw)
    assert out.model == model
    return out.choices[0].message.content


def post(server, path: str, body: dict, headers: dict = AUTH) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def test_models_lists_the_adapters_with_their_parent(client, adapters):
    cards = client.models.list().data
    assert [m.id for m in cards] == ["tiny", "sql", "chat"]
    assert not hasattr(cards[0], "parent")  # the base model's card is as before
    for card in cards[1:]:
        assert card.object == "model" and card.owned_by == "nanoinfer"
        assert card.root == adapters[card.id] and card.parent == "tiny"
        assert card.max_model_len == cards[0].max_model_len


def test_the_model_field_picks_the_adapter(client, offline):
    """Completions and chat, whole and streamed: each name gives its own model's greedy tokens."""
    for model in ("tiny", "sql", "chat"):
        expected, expected_chat = expected_text(offline, model), expected_text(offline, model, chat=True)
        assert completion(client, model) == completion(client, model, stream=True) == expected
        assert chat(client, model) == chat(client, model, stream=True) == expected_chat
    assert len({expected_text(offline, model) for model in ("tiny", "sql", "chat")}) == 3  # the adapters matter


def test_beam_search_runs_every_step_with_the_adapter(client, offline):
    llm, loras = offline
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    prompt_len = len(llm.tokenizer.encode(PROMPT))
    expected = [llm.tokenizer.decode(s.tokens[prompt_len:])
                for s in llm.beam_search([PROMPT], params, lora_request=loras["sql"])[0].sequences]
    out = client.completions.create(model="sql", prompt=PROMPT, n=2, max_tokens=3,
                                    extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.text for c in out.choices] == expected


def test_metrics_name_the_adapters_in_use(server, client):
    """vLLM's lora_requests_info: one sample whose labels name the running and waiting adapters (read here while a
    stream of adapter "sql" runs) and max_lora."""
    stream = client.completions.create(model="sql", prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    metrics = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=60).text
    stream.close()
    samples = [line for line in metrics.splitlines() if line.startswith("nanoinfer:lora_requests_info{")]
    assert len(samples) == 1 and 'max_lora="2"' in samples[0] and 'running_lora_adapters="sql"' in samples[0], samples


def test_an_unknown_model_is_a_404(server, client):
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": MESSAGES}),
                       ("/tokenize", {"prompt": "hi"})):
        response = post(server, path, body | {"model": "nope", "max_tokens": 1})
        error = response.json()["error"]
        assert response.status_code == 404 and error["code"] == 404 and error["param"] == "model"
        assert error["type"] == "not_found_error" and "['tiny', 'sql', 'chat']" in error["message"]
        assert post(server, path, body | {"model": "sql", "max_tokens": 1}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=1)


def test_adapters_load_and_unload_at_run_time(server, client, offline, adapters, tmp_path):
    load = {"lora_name": "late", "lora_path": adapters["late"]}
    assert post(server, "/v1/load_lora_adapter", load, headers={}).status_code == 401  # the API key, as elsewhere
    response = post(server, "/v1/load_lora_adapter", load)
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'late' added successfully."
    assert [m.id for m in client.models.list().data] == ["tiny", "sql", "chat", "late"]
    assert completion(client, "late") == expected_text(offline, "late")

    for body, param, words in (
            (load, "lora_name", "The lora adapter 'late' has already been loaded."),
            (load | {"lora_name": "tiny"}, "lora_name", "is the base model's served name"),
            (load | {"lora_name": "gone", "lora_path": str(tmp_path / "missing")}, "lora_path", "is not a folder"),
            (load | {"lora_name": "empty", "lora_path": str(tmp_path)}, "lora_path", "no adapter_config.json"),
            ({"lora_name": "x"}, "lora_path", "Field required"),
            (load | {"lora_path": ""}, "lora_path", "at least 1 character")):
        response = post(server, "/v1/load_lora_adapter", body)
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == param and words in error["message"], response.text

    # A stream that started before the unload finishes with its adapter.
    stream = client.completions.create(model="late", prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(stream)
    response = post(server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'late' removed successfully."
    assert first.choices[0].text + "".join(c.choices[0].text for c in stream) == expected_text(offline, "late")
    with pytest.raises(openai.NotFoundError, match="'late' does not exist"):
        completion(client, "late")
    for name in ("late", "never"):
        response = post(server, "/v1/unload_lora_adapter", {"lora_name": name})
        assert response.status_code == 404 and response.json()["error"]["message"] == \
            f"The lora adapter '{name}' cannot be found."
    # The name again, from another folder: a fresh id, so the other adapter's weights and cached blocks.
    assert post(server, "/v1/load_lora_adapter", load | {"lora_path": adapters["sql"]}).status_code == 200
    assert completion(client, "late") == expected_text(offline, "sql")
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200


def test_without_the_environment_variable_the_endpoints_do_not_exist(base, adapters, smollm2_path, tmp_path):
    srv = launch_server(str(tmp_path / "server.log"), base, "--tokenizer", smollm2_path, "--enable-lora",
                        "--lora-modules", f"sql={adapters['sql']}", "--log-stats-interval", "0")
    try:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            response = post(srv, path, {"lora_name": "late", "lora_path": adapters["late"]}, headers={})
            assert response.status_code == 404 and response.json()["error"]["code"] == 404
        assert "/v1/load_lora_adapter" not in httpx.get(f"{srv.url}/openapi.json").json()["paths"]
        assert post(srv, "/v1/completions", {"model": "sql", "prompt": "hi", "max_tokens": 1}, {}).status_code == 200
    finally:
        assert srv.stop() == 0, srv.log()


def test_lora_modules_are_checked_at_start_up(base, adapters, tmp_path):
    """Each mistake is one line and exit status 2, before the engine starts."""
    good = f"sql={adapters['sql']}"
    for args, words in (
            (["--lora-modules", good], "--lora-modules needs --enable-lora"),
            (["--enable-lora", "--lora-modules", f"bad={tmp_path / 'missing'}"], "is not a folder"),
            (["--enable-lora", "--max-lora-rank", "4", "--lora-modules", f"big={adapters['late']}"],
             "has rank 8, more than max_lora_rank=4"),
            (["--enable-lora", "--lora-modules", good, good], "The lora adapter 'sql' has already been loaded.")):
        proc = run(["serve", base, "--port", "0", *args])
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and "KV cache" not in proc.stderr


def test_lora_modules_take_both_of_vllms_forms():
    """NAME=PATH (a path may hold "=" and ","), or a JSON object; anything else is an argparse error."""
    from nanoinfer.server.cli import LoRAModulePath, lora_module

    assert lora_module("sql=/a=b/c") == LoRAModulePath("sql", "/a=b/c")
    assert lora_module('{"name": "sql", "path": "/p", "base_model_name": "m"}') == LoRAModulePath("sql", "/p", "m")
    assert lora_module('{"name": "sql", "path": "/p,q"}') == LoRAModulePath("sql", "/p,q")
    for bad in ("=/p", "sql=", "sql", '{"name": "sql", "path": 3}', '{"name": "sql", "path": "/p", "rank": 8}',
                '{"name": "sql"'):
        with pytest.raises(argparse.ArgumentTypeError):
            lora_module(bad)


def test_the_environment_variable_reads_as_vllms(monkeypatch):
    """The endpoints are on for 1 or true, in any case, on a server with --enable-lora only."""
    from nanoinfer.server.models import runtime_lora_updating

    for value, on in (("1", True), ("TRUE", True), (" true ", True), ("0", False), ("yes", False), ("", False)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert runtime_lora_updating(enable_lora=True) is on
        assert runtime_lora_updating(enable_lora=False) is False
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    assert runtime_lora_updating(enable_lora=True) is False
