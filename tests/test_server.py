"""The OpenAI-compatible server, end to end: a real `nanoinfer serve` process
(a tiny random Llama with the SmolLM2 tokenizer) driven over HTTP by the
official `openai` client and httpx."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
import transformers
from prometheus_client.parser import text_string_to_metric_families

from conftest import make_tiny_model
from nanoinfer import LLM, Logprob, SamplingParams

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_KEY = "test-key"
KV_BYTES = 16_000_000
MAX_OUTPUT_TOKENS = 1000  # the server's n x max_tokens limit
MAX_BODY = 100_000


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def core_pid(self) -> int:
        """The engine-core child (not multiprocessing's resource tracker)."""
        import psutil

        return next(c.pid for c in psutil.Process(self.proc.pid).children()
                    if any("spawn_main" in part for part in c.cmdline()))

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(log_path: str, model: str, *args: str, timeout: float = 180, wait: bool = True) -> Server:
    """Start `nanoinfer serve` and (`wait`) wait until /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "nanoinfer.cli", "serve", model, "--port", str(port), "--no-access-log",
           "--kv-cache-memory-bytes", str(KV_BYTES), *args]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    if not wait:
        return server
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not start in {timeout} s:\n{server.log()}")


def tiny_model_with_smollm2_vocab(tmp_path_factory) -> str:
    """A tiny random Llama over SmolLM2's vocabulary, made once per session (both server test files use it)."""
    path = tmp_path_factory.getbasetemp() / "tiny_llama_smollm2_vocab"
    if not (path / "config.json").exists():
        make_tiny_model(str(path), "llama", vocab_size=49152)
    return str(path)


def metric_values(url: str, headers: dict | None = None) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, keyed by (name, sorted labels without model_name)."""
    text = httpx.get(f"{url}/metrics", headers=headers).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            values[(sample.name, labels)] = sample.value
    return values


def wait_for(predicate, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# ----- fixtures -----


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return tiny_model_with_smollm2_vocab(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_path, smollm2_path, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("server_log") / "server.log")
    srv = launch_server(log, model_path, "--tokenizer", smollm2_path, "--api-key", API_KEY,
                        "--served-model-name", "tiny", "other-name",
                        "--max-output-tokens-per-request", str(MAX_OUTPUT_TOKENS),
                        "--max-request-body-bytes", str(MAX_BODY), "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def offline(model_path, smollm2_path) -> LLM:
    """The same model offline: the reference for greedy outputs."""
    return LLM(model_path, tokenizer=smollm2_path, kv_cache_memory_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


# ----- basic endpoints -----


def test_health_models_version(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200  # no key needed
    assert httpx.get(f"{server.url}/ping").status_code == httpx.post(f"{server.url}/ping").status_code == 200  # vLLM's
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", "other-name"]
    for name in ("other-name", None):  # a response names the model its request gave (vLLM's), else the first
        body = {"prompt": "hi", "max_tokens": 1} | ({"model": name} if name else {})
        assert httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH).json()["model"] == (name or "tiny")
    version = httpx.get(f"{server.url}/version", headers=AUTH).json()
    import nanoinfer

    assert version == {"version": nanoinfer.__version__}
    with pytest.raises(openai.NotFoundError, match="need a server started with --runner pooling"):
        client.embeddings.create(model="tiny", input="hi")
    for path, body in (("/v1/score", {"queries": "a", "documents": "b"}), ("/rerank", {"query": "a", "documents": ["b"]}),
                       ("/pooling", {"input": "a"})):
        response = httpx.post(f"{server.url}{path}", json=body, headers=AUTH)
        assert response.status_code == 404 and "--runner pooling" in response.json()["error"]["message"]


def test_cors_as_vllm_by_default(server):
    """Browser pages of any origin may call the server (vLLM's defaults): a preflight is answered without the key,
    and every response, a 401 too, carries the origin header."""
    origin = {"Origin": "https://page.example"}
    preflight = httpx.options(f"{server.url}/v1/chat/completions", headers=origin | {
        "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    for headers, status in ((origin | AUTH, 200), (origin, 401)):
        response = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert response.status_code == status and response.headers["access-control-allow-origin"] == "*"


def test_a_kv_cache_shorter_than_the_context_is_what_the_server_reports(model_path, smollm2_path, tmp_path):
    """128 tokens of KV cache under a 512-token context: a warning at start-up, and /v1/models and /tokenize
    give the length a request can really have (clients size their prompts from it)."""
    srv = launch_server(str(tmp_path / "server.log"), model_path, "--tokenizer", smollm2_path,
                        "--num-kv-blocks", "8", "--block-size", "16")
    try:
        assert httpx.get(f"{srv.url}/v1/models").json()["data"][0]["max_model_len"] == 128
        assert httpx.post(f"{srv.url}/tokenize", json={"prompt": "hi"}).json()["max_model_len"] == 128
        assert "the KV cache holds 128 tokens, fewer than max_model_len (512)" in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()


def test_tokenize_detokenize(server, offline):
    text = "Hello there, general Kenobi!"
    tokens = httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"prompt": text}).json()
    assert tokens["tokens"] == offline.tokenizer.encode(text)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    back = httpx.post(f"{server.url}/detokenize", headers=AUTH, json={"tokens": tokens["tokens"]}).json()
    assert back == {"prompt": text}
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"messages": messages}).json()
    assert chat["tokens"] == offline.apply_chat_template(messages)
    started = messages + [{"role": "assistant", "content": "Hello"}]
    body = {"messages": started, "add_generation_prompt": False, "continue_final_message": True}
    cont = httpx.post(f"{server.url}/tokenize", headers=AUTH, json=body).json()
    assert cont["tokens"] == offline.apply_chat_template(started, False, continue_final_message=True)


def test_text_content_parts_join_with_newlines(server, offline):
    """As vLLM reads a message's content parts: text, input_text, output_text and refusal are text, joined by
    newlines; any other part is a 400."""
    parts = [{"type": "text", "text": "Hello"}, {"type": "input_text", "text": "there"},
             {"type": "output_text", "text": "general"}, {"type": "refusal", "refusal": "Kenobi"}]
    tokens = httpx.post(f"{server.url}/tokenize", headers=AUTH,
                        json={"messages": [{"role": "user", "content": parts}]}).json()["tokens"]
    assert tokens == offline.apply_chat_template([{"role": "user", "content": "Hello\nthere\ngeneral\nKenobi"}])
    for bad in ({"type": "image_url", "image_url": {"url": "http://x"}}, {"type": "refusal", "text": "no"}):
        response = httpx.post(f"{server.url}/tokenize", headers=AUTH,
                              json={"messages": [{"role": "user", "content": [parts[0], bad]}]})
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
        assert bad["type"] in response.json()["error"]["message"]


def test_a_client_names_its_response(server):
    """vLLM's X-Request-Id header (or the body's request_id; the header wins) names the response; two requests
    of one name at once each get their own completion."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0}

    async def run() -> list[dict]:
        async with httpx.AsyncClient(headers=AUTH, timeout=60) as http:
            return [r.json() for r in await asyncio.gather(*(
                http.post(f"{server.url}/v1/completions", json=body, headers={"X-Request-Id": "same"})
                for _ in range(3)))]

    responses = asyncio.run(run())
    assert [r["id"] for r in responses] == ["cmpl-same"] * 3
    assert all(r["usage"]["completion_tokens"] == 3 for r in responses)
    assert server.log().count("is the client's 'same'") == 3  # the log ties the name to the engine's ids
    chat = {"model": "tiny", "messages": CHAT, "max_tokens": 2, "request_id": "mine"}
    assert httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, json=chat).json()["id"] == "chatcmpl-mine"
    named = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH | {"X-Request-Id": "hdr"}, json=chat)
    assert named.json()["id"] == "chatcmpl-hdr"
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=AUTH | {"X-Request-Id": "s"},
                      json=chat | {"stream": True}) as response:
        ids = {json.loads(line[6:])["id"] for line in response.iter_lines() if line.startswith("data: {")}
    assert ids == {"chatcmpl-s"}
    for unnamed in (body, body | {"request_id": ""}):
        assert re.fullmatch(r"cmpl-[0-9a-f]{32}", httpx.post(f"{server.url}/v1/completions", headers=AUTH,
                                                              json=unnamed).json()["id"])


def test_an_error_names_the_field_the_client_sent(server):
    response = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH,
                          json={"messages": CHAT, "max_completion_tokens": 0})
    error = response.json()["error"]
    assert error["param"] == "max_completion_tokens" and error["message"].startswith("max_completion_tokens must be")
    response = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH,
                          json={"messages": CHAT, "max_tokens": 0})
    assert response.json()["error"]["message"].startswith("max_tokens must be")
    too_long = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH,  # named inside the message too
                          json={"messages": CHAT, "max_completion_tokens": 999}).json()["error"]
    assert "+ max_completion_tokens (999) =" in too_long["message"] and "max_tokens" not in too_long["message"]


# ----- generation -----


def test_completion_matches_offline(client, offline):
    prompt = "The capital of France is"
    ref = offline.generate(prompt, greedy(12, ignore_eos=True), use_tqdm=False)[0]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == "tiny"
    assert out.choices[0].text == ref.outputs[0].text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == 12 and out.usage.total_tokens == 12 + len(ref.prompt_token_ids)


def test_completion_max_tokens_null_is_the_rest_of_the_context(server):
    """vLLM's reading: max_tokens left out is 16, an explicit null runs to the end of the context."""
    body = {"model": "tiny", "prompt": "The capital of France is", "temperature": 0, "ignore_eos": True}
    omitted = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=120).json()
    null = httpx.post(f"{server.url}/v1/completions", json=body | {"max_tokens": None}, headers=AUTH,
                      timeout=120).json()
    assert omitted["usage"]["completion_tokens"] == 16
    assert null["usage"]["total_tokens"] == 512 and null["choices"][0]["finish_reason"] == "length"


def test_logit_bias_matches_offline(client, offline):
    prompt, bias = "The capital of France is", {"42": 100, "1000": -100}
    ref = offline.generate(prompt, greedy(6, ignore_eos=True, logit_bias={int(k): v for k, v in bias.items()}),
                           use_tqdm=False)[0].outputs[0]
    assert ref.token_ids == [42] * 6
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logit_bias=bias,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == ref.text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0.8, logit_bias=bias, logprobs=True)
    assert [t.token for t in chat.choices[0].logprobs.content] == [offline.tokenizer.decode([42])] * 3


def test_streaming_equals_non_streaming(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len(chunks) > 3  # really streamed
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    continuous = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True,
                                                                                   "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in continuous]  # vLLM's option: the usage so far in every chunk
    assert counts == sorted(counts) and counts[-1] == 20 and counts[0] < 20
    assert all(c.usage.prompt_tokens == full.usage.prompt_tokens for c in continuous)
    # As vLLM's: stream_options given at all asks for usage; a chunk's continuous usage is its own choice's.
    for options in ({}, {"continuous_usage_stats": True}):
        last = list(client.completions.create(**kw, stream=True, stream_options=options))[-1]
        assert last.usage.completion_tokens == 20
    two = dict(kw, prompt=["Once upon a time", "Hi"], n=2, max_tokens=3)
    chunks = list(client.completions.create(**two, stream=True, stream_options={"continuous_usage_stats": True}))
    seen: dict[int, int] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        seen[choice.index] = seen.get(choice.index, 0) + 1
        assert chunk.usage.completion_tokens == seen[choice.index]  # one token per chunk here, counted per choice
        assert chunk.usage.prompt_tokens == (full.usage.prompt_tokens if choice.index < 2 else 1)
    assert seen == {0: 3, 1: 3, 2: 3, 3: 3} and chunks[-1].usage.completion_tokens == 12


def test_prompt_forms_and_echo(client, offline):
    ids = offline.tokenizer.encode("Hello world")
    params = dict(model="tiny", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    by_text = client.completions.create(prompt="Hello world", **params).choices[0].text
    assert client.completions.create(prompt=ids, **params).choices[0].text == by_text
    many = client.completions.create(prompt=[ids, [5, 6, 7]], **params)
    assert [c.index for c in many.choices] == [0, 1] and many.choices[0].text == by_text
    assert many.usage.prompt_tokens == len(ids) + 3 and many.usage.completion_tokens == 8
    texts = client.completions.create(prompt=["Hello world", "Bye"], n=2, **params)
    assert [c.index for c in texts.choices] == [0, 1, 2, 3]
    salted = dict(params, extra_body={"ignore_eos": True, "cache_salt": "tenant-1"})
    assert client.completions.create(prompt="Hello world", **salted).choices[0].text == by_text
    with pytest.raises(openai.BadRequestError, match="needs scheduling_policy='priority'"):  # as vLLM's
        client.completions.create(prompt="Hello world", **dict(params, extra_body={"priority": 3}))
    echoed = client.completions.create(prompt="Hello world", echo=True, **params).choices[0].text
    assert echoed == "Hello world" + by_text
    stream = client.completions.create(prompt=["Hello world", "Bye"], echo=True, stream=True, **params)
    texts = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts[0] == "Hello world" + by_text and texts[1].startswith("Bye")


def test_chat_matches_offline(client, offline):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ref = offline.chat(messages, greedy(10, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    kw = dict(model="tiny", messages=messages, max_completion_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    out = client.chat.completions.create(**kw)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == ref
    assert out.usage.prompt_tokens == len(offline.apply_chat_template(messages))
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_echo_continues_the_assistants_message(client, offline):
    """vLLM's chat `echo`: the reply starts with the last message's text when it is the assistant's (a reply the
    model continues), streamed or not; after a user's message there is nothing to echo."""
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My answer is"}]
    kw = dict(model="tiny", messages=messages, max_tokens=6, temperature=0,
              extra_body={"echo": True, "continue_final_message": True, "add_generation_prompt": False,
                          "ignore_eos": True})
    plain = client.chat.completions.create(**kw | {"extra_body": kw["extra_body"] | {"echo": False}})
    echoed = client.chat.completions.create(**kw).choices[0].message.content
    assert echoed == "My answer is" + plain.choices[0].message.content
    streamed = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == echoed
    assert streamed[0].choices[0].delta.content.startswith("My answer is")
    after_user = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, temperature=0,
                                                extra_body={"echo": True, "ignore_eos": True})
    assert after_user.choices[0].message.content == client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}).choices[0].message.content


def test_n_and_seed(client):
    kw = dict(model="tiny", prompt="Random words:", max_tokens=8, temperature=1.0, n=3, seed=1234,
              extra_body={"ignore_eos": True})
    first = client.completions.create(**kw)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert len({c.text for c in first.choices}) > 1  # the children sample differently
    assert first.usage.completion_tokens == 24
    assert [c.text for c in client.completions.create(**kw).choices] == [c.text for c in first.choices]
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in first.choices]


def test_stop_strings(client):
    kw = dict(model="tiny", prompt="The capital of France is", temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(max_tokens=16, **kw).choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text[: text.index(stop)]
    out = client.completions.create(max_tokens=16, stop=[stop], **kw).choices[0]
    assert (out.text, out.finish_reason) == (cut, "stop")
    assert out.model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(max_tokens=16, stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    kw["extra_body"] = {"ignore_eos": True, "include_stop_str_in_output": True}
    assert client.completions.create(max_tokens=16, stop=stop, **kw).choices[0].text == cut + stop


def test_logprobs(client):
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True}).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and value <= 0
        assert top[token] == value == max(top.values())  # greedy picks the top token
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True}).choices[0]
    content = chat.logprobs.content
    assert len(content) == 4 and "".join(c.token for c in content) == chat.message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == c.logprob
        assert bytes(c.bytes).decode() == c.token


def test_echo_with_logprobs_scores_the_prompt(client, offline):
    """As an evaluation harness scores text (lm-eval's loglikelihood): echo + logprobs give the prompt's tokens
    their logprobs too, the first one null, streamed or not."""
    prompt = "The quick brown fox jumps over the lazy dog"
    ref = offline.generate(prompt, greedy(2, ignore_eos=True, logprobs=1, prompt_logprobs=1), use_tqdm=False)[0]
    ids = ref.prompt_token_ids
    kw = dict(model="tiny", prompt=prompt, max_tokens=2, temperature=0, logprobs=1, echo=True,
              extra_body={"ignore_eos": True})
    out = client.completions.create(**kw).choices[0]
    streamed = list(client.completions.create(stream=True, **kw))
    for lp, text in ((out.logprobs, out.text), (streamed[0].choices[0].logprobs, None)):
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.tokens[: len(ids)] == [offline.tokenizer.decode([t]) for t in ids]
        for i in range(1, len(ids)):
            assert lp.token_logprobs[i] == pytest.approx(ref.prompt_logprobs[i][ids[i]].logprob, abs=1e-5)
            assert 1 <= len(lp.top_logprobs[i]) <= 2
        assert lp.text_offset[: len(ids)] == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
        if text is not None:  # the whole response: the prompt's tokens, then the completion's
            assert out.text == prompt + ref.outputs[0].text and len(lp.tokens) == len(ids) + 2
            assert lp.token_logprobs[len(ids):] == pytest.approx([d[t].logprob for d, t in zip(ref.outputs[0].logprobs,
                                                                                      ref.outputs[0].token_ids)])
            assert lp.text_offset[len(ids)] == len(prompt)
    assert "".join(c.choices[0].text for c in streamed) == out.text
    # Every chunk's offsets count from the start of the whole choice, the echoed prompt included.
    assert [o for c in streamed for o in c.choices[0].logprobs.text_offset] == out.logprobs.text_offset
    # max_tokens 0 with echo scores the prompt alone (vLLM's reading): its text and logprobs, nothing generated.
    for stream in (False, True):
        got = client.completions.create(**{**kw, "max_tokens": 0}, stream=stream,
                                        **({"stream_options": {"include_usage": True}} if stream else {}))
        chunks = list(got) if stream else [got]
        choice, usage = chunks[0].choices[0], chunks[-1].usage
        assert choice.text == prompt and len(choice.logprobs.tokens) == len(ids)
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(out.logprobs.token_logprobs[1 : len(ids)])
        assert choice.finish_reason == "length" and usage.completion_tokens == 0
        assert usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # without echo there is nothing to return
        client.completions.create(model="tiny", prompt=prompt, max_tokens=0)
    # A wider prompt_logprobs (its own field) leaves the echoed prompt's top lists at logprobs' width (vLLM's).
    wide = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "prompt_logprobs": 5}}).choices[0]
    assert wide.logprobs.top_logprobs[1:] == out.logprobs.top_logprobs[1:]
    assert all(len(p) == 6 for p in wide.model_extra["prompt_logprobs"][1:])


def test_allowed_token_ids_restrict_the_reply(client, offline):
    """vLLM's allowed_token_ids: every sampled token is one of them, and the reply is the offline engine's."""
    allowed = offline.tokenizer.encode(" yes no maybe")
    kw = dict(model="tiny", prompt="Answer:", max_tokens=6, temperature=0)
    out = client.completions.create(**kw, extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    ref = offline.generate("Answer:", greedy(6, allowed_token_ids=allowed, ignore_eos=True), use_tqdm=False)[0]
    assert set(ref.outputs[0].token_ids) <= set(allowed) and out.choices[0].text == ref.outputs[0].text


def test_bad_words_are_kept_out_of_the_reply(client, offline):
    """vLLM's bad_words: the reply is the offline engine's with the same words banned, and none of them is in it."""
    free = offline.generate("Answer:", greedy(8, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    word = offline.tokenizer.decode(free.token_ids[2:3]).strip() or "the"
    ref = offline.generate("Answer:", greedy(8, ignore_eos=True, bad_words=[word]), use_tqdm=False)[0].outputs[0]
    out = client.completions.create(model="tiny", prompt="Answer:", max_tokens=8, temperature=0,
                                    extra_body={"bad_words": [word], "ignore_eos": True})
    assert out.choices[0].text == ref.text and ref.token_ids != free.token_ids


def test_beam_search_matches_offline(client, offline):
    """vLLM's use_beam_search: the n choices are offline beam_search's n best sequences, best first, on both
    endpoints; a streaming request gets them as one chunk each; a field beam search would not follow is a 400."""
    from nanoinfer import BeamSearchParams

    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True, length_penalty=0.5)
    expected = offline.beam_search(["The weather is"], params)[0].sequences
    prompt_len = len(offline.tokenizer.encode("The weather is"))
    texts = [offline.tokenizer.decode(s.tokens[prompt_len:]) for s in expected]
    beam = {"use_beam_search": True, "ignore_eos": True, "length_penalty": 0.5}
    out = client.completions.create(model="tiny", prompt="The weather is", n=3, max_tokens=5, extra_body=beam)
    assert [c.text for c in out.choices] == texts and out.usage.completion_tokens == 15
    assert [c.finish_reason for c in out.choices] == ["length"] * 3
    chunks = client.completions.create(model="tiny", prompt="The weather is", n=3, max_tokens=5, stream=True,
                                       extra_body=beam)
    streamed = {}
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == texts
    messages = [{"role": "user", "content": "Hi"}]
    chat_prompt = offline.apply_chat_template(messages)
    chat_expected = offline.beam_search([chat_prompt], params)[0].sequences
    chat = client.chat.completions.create(model="tiny", messages=messages, n=3, max_tokens=5, extra_body=beam)
    assert [c.message.content for c in chat.choices] == [
        offline.tokenizer.decode(s.tokens[len(chat_prompt):], skip_special_tokens=True) for s in chat_expected]
    for extra, param in (({"top_p": 0.5}, "top_p"), ({"logprobs": 2}, "logprobs"), ({"n": 11}, "n"),
                         ({"n": 10, "max_tokens": MAX_OUTPUT_TOKENS // 10 + 1}, "max_tokens")):
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "use_beam_search": True} | extra
        response = httpx.post(f"{client.base_url}completions", json=body, headers=AUTH)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    response = httpx.post(f"{client.base_url}completions", json={"prompt": "x", "length_penalty": 2.0}, headers=AUTH)
    assert response.status_code == 400 and response.json()["error"]["param"] == "length_penalty"
    for length_penalty in (2000, -2000):  # length ** length_penalty would overflow a float: ranked in log space
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "use_beam_search": True,
                "length_penalty": length_penalty}
        assert httpx.post(f"{client.base_url}completions", json=body, headers=AUTH).status_code == 200


def test_a_beam_ended_by_eos_leaves_its_text_out(offline, model_path, smollm2_path, tmp_path):
    """As a sampled request's and vLLM's server's: a beam's end-of-sequence token counts as a completion token,
    but its text is not in the choice's, even with skip_special_tokens false (here it is an ordinary word: the
    tiny model's most likely first token made its end-of-sequence token)."""
    from nanoinfer import BeamSearchParams

    first = offline.beam_search(["hi"], BeamSearchParams(beam_width=1, max_tokens=1, ignore_eos=True))[0]
    eos = first.sequences[0].tokens[-1]
    folder = tmp_path / "model"
    shutil.copytree(model_path, folder)
    for name in ("config.json", "generation_config.json"):
        if (folder / name).exists():
            (folder / name).write_text(json.dumps(json.loads((folder / name).read_text()) | {"eos_token_id": eos}))
    srv = launch_server(str(tmp_path / "server.log"), str(folder), "--tokenizer", smollm2_path)
    try:
        body = {"prompt": "hi", "n": 2, "max_tokens": 3, "use_beam_search": True, "skip_special_tokens": False,
                "length_penalty": -2.0}  # short beams first
        out = httpx.post(f"{srv.url}/v1/completions", json=body).json()
    finally:
        assert srv.stop() == 0, srv.log()
    stopped = [c for c in out["choices"] if c["finish_reason"] == "stop"]
    assert stopped and all(c["text"] == "" for c in stopped), out["choices"]  # the one token is the end of sequence
    assert offline.tokenizer.decode([eos]) != ""
    assert out["usage"]["completion_tokens"] == sum(1 if c["finish_reason"] == "stop" else 3 for c in out["choices"])


def test_truncate_prompt_tokens_keeps_the_prompts_end(client, offline):
    """vLLM's truncate_prompt_tokens: the prompt keeps its last k tokens; usage counts them, echo returns their
    text, and the reply is the one to them alone."""
    prompt = "one two three four five six seven eight nine ten"
    kept = offline.tokenizer.encode(prompt)[-4:]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                    extra_body={"truncate_prompt_tokens": 4, "ignore_eos": True})
    alone = offline.generate(kept, greedy(3, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    assert out.usage.prompt_tokens == 4 and out.choices[0].text == offline.tokenizer.decode(kept) + alone


def test_prompt_logprobs_as_vllm_gives_them(client, offline):
    """vLLM's prompt_logprobs: each prompt token's logprob, rank and text, plus the top-n, keyed by token id (null
    at position 0), as the offline engine computes them: in each completions choice, at the top of a chat
    response."""
    prompt = "The quick brown fox jumps over the lazy dog"
    ref = offline.generate(prompt, greedy(1, prompt_logprobs=2), use_tqdm=False)[0]
    ids = ref.prompt_token_ids

    def check(got: list, ref_entries: list, ids: list[int]) -> None:
        assert len(got) == len(ids) and got[0] is None
        for entry, ref_entry, token in zip(got[1:], ref_entries[1:], ids[1:]):
            assert set(entry) == {str(t) for t in ref_entry} and str(token) in entry and 2 <= len(entry) <= 3
            for t, lp in ref_entry.items():
                assert entry[str(t)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
                assert entry[str(t)]["rank"] == lp.rank and entry[str(t)]["decoded_token"] == lp.decoded_token

    out = client.completions.create(model="tiny", prompt=[prompt, prompt], max_tokens=1, temperature=0, n=2,
                                    extra_body={"prompt_logprobs": 2})
    assert len(out.choices) == 4
    for choice in out.choices:  # every choice of every prompt carries its prompt's
        check(choice.model_extra["prompt_logprobs"], ref.prompt_logprobs, ids)
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert "prompt_logprobs" not in plain.choices[0].model_extra
    messages = [{"role": "user", "content": "Hi there"}]
    chat_ref = offline.generate(offline.apply_chat_template(messages), greedy(1, prompt_logprobs=0), use_tqdm=False)[0]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, temperature=0,
                                          extra_body={"prompt_logprobs": 0})
    got = chat.model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(chat_ref.prompt_token_ids)
    for entry, ref_entry, token in zip(got[1:], chat_ref.prompt_logprobs[1:], chat_ref.prompt_token_ids[1:]):
        assert list(entry) == [str(token)]  # top 0: the token's own entry alone
        assert entry[str(token)]["logprob"] == pytest.approx(ref_entry[token].logprob, abs=1e-5)
        assert entry[str(token)]["rank"] == ref_entry[token].rank >= 1


def test_a_grammar_that_allows_nothing_is_a_clean_error(server):
    """No token to sample (it sampled a stand-in whose NaN logprobs made the response a bare 500 from the JSON
    encoder, and a stream of invalid JSON): the request fails alone, in OpenAI's error form, streamed or not."""
    def strict(text: str):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in {text}"))

    body = {"prompt": "hi", "max_tokens": 4, "logprobs": 2, "structured_outputs": {"regex": "[^\\s\\S]"}}
    response = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json=body)
    assert response.status_code == 500 and "failed inside the engine" in strict(response.text)["error"]["message"]
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, json=body | {"stream": True}) as events:
        lines = [line[6:] for line in events.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]" and "failed inside the engine" in strict(lines[-2])["error"]["message"]
    assert all(strict(line) for line in lines[:-1])
    assert httpx.post(f"{server.url}/v1/completions", headers=AUTH, json={"prompt": "hi", "max_tokens": 2}
                      ).status_code == 200


def test_structured_outputs_match_offline(client, offline):
    """response_format (OpenAI's json_object / json_schema) and vLLM's structured_outputs reach the sampler: the
    served text is the offline engine's under the same grammar, streamed or not."""
    from nanoinfer import StructuredOutputsParams

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}},
              StructuredOutputsParams(json=schema), lambda text: isinstance(json.loads(text)["ok"], bool)),
             ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True),
              lambda text: isinstance(json.loads(text), dict)),
             ({"structured_outputs": {"choice": ["left", "right"]}}, StructuredOutputsParams(choice=["left", "right"]),
              lambda text: text in ("left", "right")),
             ({"structured_outputs": {"regex": "[a-c]{3}"}}, StructuredOutputsParams(regex="[a-c]{3}"),
              lambda text: re.fullmatch("[a-c]{3}", text)),
             # vLLM's older names, as many clients still send them
             ({"guided_choice": ["up", "down"]}, StructuredOutputsParams(choice=["up", "down"]),
              lambda text: text in ("up", "down")),
             ({"guided_json": json.dumps(schema)}, StructuredOutputsParams(json=schema),
              lambda text: isinstance(json.loads(text)["ok"], bool))]
    for body, spec, valid in cases:
        ref = offline.generate("Pick one:", greedy(24, structured_outputs=spec), use_tqdm=False)[0].outputs[0]
        out = client.completions.create(model="tiny", prompt="Pick one:", max_tokens=24, temperature=0,
                                        extra_body=body)
        assert out.choices[0].text == ref.text, body
        streamed = client.completions.create(model="tiny", prompt="Pick one:", max_tokens=24, temperature=0,
                                             stream=True, extra_body=body)
        assert "".join(c.choices[0].text for c in streamed) == ref.text
        # A random model may pad JSON with whitespace past max_tokens; the short grammars always end.
        assert valid(ref.text) if ref.finish_reason == "stop" else not {"structured_outputs", "guided_choice"} & set(body)
    choice = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "left or right?"}],
                                            max_tokens=8, temperature=0,
                                            extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert choice.choices[0].message.content in ("left", "right")


TOOLS = [{"type": "function", "function": {
              "name": "get_weather", "description": "The weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                              "unit": {"enum": ["c", "f"]}},
                             "required": ["city", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {
             "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                                "required": ["zone"], "additionalProperties": False}}}]


def streamed_reply(chunks) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) of a streamed chat reply, tool call deltas merged by index."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            if call.id is not None:
                assert call.id.startswith("chatcmpl-tool-") and call.type == "function" and call.index not in calls
                calls[call.index] = [call.function.name, ""]
            calls[call.index][1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [tuple(c) for c in calls.values()], finish


def test_tool_choice_required_and_named_match_offline(client, offline):
    """A named function or "required": the reply is constrained to the tools' schemas (compact JSON) and read back
    as tool calls, streamed or not; the text under that grammar is the offline engine's."""
    from nanoinfer import StructuredOutputsParams
    from nanoinfer.server.tool_calls import parameters_schema, required_schema

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    cases = [({"type": "function", "function": {"name": "get_weather"}}, parameters_schema(TOOLS, "get_weather"),
              lambda text: [("get_weather", text)], "stop"),
             ("required", required_schema(TOOLS, parallel=True),
              lambda text: [(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)], "tool_calls")]
    for tool_choice, schema, calls_of, finish in cases:
        spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        ref = offline.chat(messages, greedy(64, structured_outputs=spec), use_tqdm=False, tools=TOOLS)[0].outputs[0]
        assert ref.finish_reason == "stop", ref.text  # compact JSON over enums: it ends well before 64 tokens
        expected = calls_of(ref.text)
        kw = dict(model="tiny", messages=messages, tools=TOOLS, tool_choice=tool_choice, max_tokens=64, temperature=0)
        out = client.chat.completions.create(**kw)
        message = out.choices[0].message
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == expected
        assert message.content is None and out.choices[0].finish_reason == finish
        assert len({c.id for c in message.tool_calls}) == len(expected)
        assert streamed_reply(client.chat.completions.create(**kw, stream=True)) == ("", expected, finish)


def test_tool_choice_auto_reads_hermes_calls(client):
    """tool_choice "auto" (the default with tools) on a server started with --tool-call-parser hermes: the text
    before <tool_call> is content, each block a call. The random model is made to write one by a regex."""
    forced = {"structured_outputs": {"regex": r'Sure\. <tool_call>\{"name": "get_weather", "arguments": '
                                              r'\{"city": "(Paris|Rome)", "unit": "c"\}\}</tool_call>'}}
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, max_tokens=64,
              temperature=0, extra_body=forced)
    out = client.chat.completions.create(**kw)
    message, call = out.choices[0].message, out.choices[0].message.tool_calls[0]
    assert message.content == "Sure. " and len(message.tool_calls) == 1 and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert out.choices[0].finish_reason == "tool_calls"
    expected = ("Sure. ", [("get_weather", call.function.arguments)], "tool_calls")
    assert streamed_reply(client.chat.completions.create(**kw, stream=True)) == expected
    plain = client.chat.completions.create(**kw, tool_choice="none").choices[0]  # the same text, not read as calls
    assert plain.message.content.startswith("Sure. <tool_call>") and plain.message.tool_calls is None
    assert plain.finish_reason == "stop"


def test_reasoning_comes_apart_from_content(client):
    """--reasoning-parser qwen3: a reply that opens with <think> has its reasoning in reasoning_content (streamed
    in deltas of their own), the rest in content; tool calls are read from the content only."""
    forced = r'<think>\nThe user wants (rain|sun)\.</think>\n\nSure\. <tool_call>\{"name": "get_time", ' \
             r'"arguments": \{"zone": "utc"\}\}</tool_call>'
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], max_tokens=128, temperature=0,
              tools=TOOLS, extra_body={"structured_outputs": {"regex": forced}})
    message = client.chat.completions.create(**kw).choices[0].message
    assert re.fullmatch(r"\nThe user wants (rain|sun)\.", message.reasoning_content)
    assert message.content == "\n\nSure. " and [c.function.name for c in message.tool_calls] == ["get_time"]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks) == \
        message.reasoning_content
    assert streamed_reply(chunks) == ("\n\nSure. ", [("get_time", '{"zone": "utc"}')], "tool_calls")
    hidden = client.chat.completions.create(**kw | {"extra_body": kw["extra_body"] | {"include_reasoning": False}})
    assert getattr(hidden.choices[0].message, "reasoning_content", None) is None
    assert hidden.choices[0].message.content == "\n\nSure. "
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert plain.choices[0].message.reasoning_content is None and plain.choices[0].message.content


def test_conversation_with_tool_calls_and_results(client, offline, server):
    """An assistant's earlier calls and the tool's answer go through the chat template (SmolLM2's renders their
    content), as /tokenize with the same tools shows."""
    messages = [{"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call-1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "c"}'}}]},
                {"role": "tool", "content": "22 degrees", "tool_call_id": "call-1"}]
    rendered = offline.apply_chat_template(messages, tools=TOOLS)  # the same conversation renders the same offline
    out = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                         max_tokens=4, temperature=0)
    assert out.usage.prompt_tokens == len(rendered)
    tokens = httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"messages": messages, "tools": TOOLS}).json()
    assert tokens["tokens"] == rendered


def test_64_concurrent_streams_match_offline(server, offline):
    prompts = [f"Request number {i} says:" + " word" * (i % 7) for i in range(64)]
    refs = [o.outputs[0].text for o in offline.generate(prompts, greedy(8, ignore_eos=True), use_tqdm=False)]

    async def run() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

        async def one(prompt: str) -> str:
            stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True})
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    assert asyncio.run(run()) == refs


# ----- robustness -----


def _abort_count(server) -> float:
    return metric_values(server.url, AUTH).get(("nanoinfer:request_success_total", (("finished_reason", "abort"),)), 0)


def _idle(server) -> bool:
    values = metric_values(server.url, AUTH)
    return values[("nanoinfer:num_requests_running", ())] == 0 and values[("nanoinfer:kv_cache_blocks_in_use", ())] == 0


def test_disconnect_aborts_and_frees_blocks(server):
    body = {"model": "tiny", "prompt": "Tell me a long story", "max_tokens": 480, "ignore_eos": True}
    aborts = _abort_count(server)
    with httpx.Client(timeout=60, headers=AUTH) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body | {"stream": True}) as response:
            events = (line for line in response.iter_lines() if line.startswith("data: "))
            for _ in range(3):
                next(events)
            values = metric_values(server.url, AUTH)
            assert values[("nanoinfer:num_requests_running", ())] == 1
            assert values[("nanoinfer:kv_cache_blocks_in_use", ())] >= 1
    wait_for(lambda: _idle(server), what="the streaming request's blocks to be freed")
    assert _abort_count(server) == aborts + 1
    # A non-streaming client that gives up is noticed too (it waits a quarter of the ~1 s the request takes here:
    # a faster CI machine finished it within a 1 s wait).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", headers=AUTH, json=body, timeout=0.25)
    wait_for(lambda: _abort_count(server) == aborts + 2, what="the non-streaming request to be aborted")
    wait_for(lambda: _idle(server), what="the non-streaming request's blocks to be freed")


CHAT = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [  # (path, JSON body or raw bytes, status, param)
    ("/v1/completions", b'{"prompt": "hi",', 400, None),
    ("/v1/completions", b"\xff\xfe garbage", 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi " * 600}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "bad_words": ["fine", ""]}, 400, "bad_words"),
    ("/v1/completions", {"prompt": "hi", "bad_words": ["  "]}, 400, "bad_words"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [5, 10**7]}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 10**6}, 400, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": -1}, 400,
     "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    # Types as the schema gives them, as OpenAI checks them (the API fuzzer's negative cases): no coercion.
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": True}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "min_tokens": 2.0}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 20, "max_tokens": 10}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 4, "max_tokens": 300}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 8}, 400, "max_tokens"),  # unset: the rest of the context
    ("/v1/completions", {"prompt": "hi", "n": 8, "max_tokens": None}, 400, "max_tokens"),  # null: the same
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "return_tokens_as_token_ids": True}, 400, "return_tokens_as_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "return_token_ids": True}, 400, "return_token_ids"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True, "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2**70}, 400, "top_k"),  # past 64 bits: named, as every int
    ("/v1/chat/completions", {"messages": CHAT, "min_tokens": 2**70}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "model": "nope"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 600}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "nope"}, 404, "model"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    # Bounded per-token work (a client's long lists would slow every request in the batch).
    ("/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(129)]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": list(range(1025))}, 400, "stop_token_ids"),
    # Fields that would change the output but are not implemented: refused, not ignored.
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"42": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"4200000": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"42": "high"}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {}}, 400, "response_format"),  # type required
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
     "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": {"type": "no-such-type"}}}, 400,
     "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "(unclosed"}}, 400, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "(unclosed"}, 400, "guided_regex"),
    ("/v1/completions", {"prompt": "hi", "guided_choice": ["a"], "guided_regex": "b"}, 400, "guided_regex"),
    ("/v1/completions", {"prompt": "hi", "guided_grammar": "x", "structured_outputs": {"regex": "b"}}, 400,
     "guided_grammar"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, 400,
     "tool_choice"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": functools.reduce(
        lambda inner, _: {"type": "array", "items": [inner]}, range(300), {})}}, 400, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "max_tokens": 0, "min_tokens": 1}, 400, "min_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": "sometimes"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, 400,
     "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS + TOOLS[:1]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"id": "x", "type": "function"}]}]},
     400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, 400,
     "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tokenize": False}}, 400, "chat_template_kwargs"),
    ("/tokenize", {}, 400, "prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/v1/nothing-here", {}, 404, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{server.url}{path}", headers=AUTH, timeout=30, **kw)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == status and error["message"]
    assert "Traceback" not in response.text


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", {"prompt": "hi " * 15_000}, "prompt", "characters long"),
    ("/tokenize", {"prompt": "hi " * 15_000}, "prompt", "characters long"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 15_000}]}, "messages",
     "characters long"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * 600}, "messages",
     "600 messages cannot fit"),
])
def test_text_too_long_for_the_context_is_refused_before_tokenizing(server, path, body, param, words):
    """45,000 characters cannot fit in 512 tokens of SmolLM2's (its longest token spells 81): refused before the
    tokenizer or the chat template runs on the event loop (4 MB of text took ~5 s there, stalling every stream)."""
    response = httpx.post(f"{server.url}{path}", headers=AUTH, timeout=30, json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert words in response.json()["error"]["message"]


def test_null_means_the_default(server):
    """OpenAI's nullable fields: clients that send unset fields as null are served as if they left them out."""
    nulls = {"n": None, "stream": None, "stop": None, "seed": None, "temperature": 0, "stream_options": None,
             "logit_bias": None, "response_format": None, "tools": None, "tool_choice": None}
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2, "echo": None, "best_of": None,
                                            "logprobs": None, "suffix": None}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": None}],
                                                 "max_tokens": 2, "logprobs": None, "echo": None})):
        response = httpx.post(f"{server.url}{path}", headers=AUTH, timeout=30, json=body | nulls)
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 1
    text_only = {"response_format": {"type": "text"}, "tool_choice": "none",
                 "tools": [{"type": "function", "function": {"name": "f"}}]}
    response = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=30,
                          json={"messages": CHAT, "max_tokens": 2} | text_only)
    assert response.status_code == 200, response.text


def test_client_leaving_mid_upload_is_not_an_error(server):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
    assert httpx.get(f"{server.url}/health").status_code == 200
    time.sleep(0.5)
    assert "Traceback" not in server.log() and "internal error" not in server.log()


def test_auth_and_limits(server):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{server.url}/v1/completions", headers=headers, json=body)
        assert response.status_code == 401 and response.json()["error"]["code"] == 401
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    assert httpx.post(f"{server.url}/v1/completions", headers=AUTH, json=body).status_code == 200
    big = {"model": "tiny", "prompt": "x" * (MAX_BODY + 10)}
    response = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json=big)
    assert response.status_code == 413 and response.json()["error"]["code"] == 413
    assert httpx.get(f"{server.url}/v1/completions", headers=AUTH).status_code == 405


def test_unexpected_errors_are_500_without_internals():
    """In-process: a bug in a handler becomes an OpenAI-style 500 that reveals nothing."""
    from types import SimpleNamespace

    from nanoinfer.server.api_server import ServeOptions, build_app

    class Broken:
        accepting = True

        async def create_completion(self, req, raw):
            raise RuntimeError("secret internals")

    app = build_app(SimpleNamespace(check_alive=lambda: None), Broken(), ServeOptions())

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.post("/v1/completions", json={"prompt": "hi"})

    response = asyncio.run(post())
    assert response.status_code == 500 and response.json()["error"]["code"] == 500
    assert "secret" not in response.text and "Traceback" not in response.text


def test_metrics_move(server, client):
    def counters() -> dict:
        values = metric_values(server.url, AUTH)
        return {name: values.get((name, labels), 0) for name, labels in [
            ("nanoinfer:request_success_total", (("finished_reason", "length"),)),
            ("nanoinfer:prompt_tokens_total", ()), ("nanoinfer:generation_tokens_total", ()),
            ("nanoinfer:time_to_first_token_seconds_count", ()), ("nanoinfer:e2e_request_latency_seconds_count", ()),
            ("nanoinfer:inter_token_latency_seconds_count", ()), ("nanoinfer:request_queue_time_seconds_count", ()),
            ("nanoinfer:prefix_cache_queries_total", ())]}

    before = counters()
    out = client.completions.create(model="tiny", prompt=[7, 8, 9, 10], max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    wait_for(lambda: counters()["nanoinfer:request_success_total"] == before["nanoinfer:request_success_total"] + 1)
    delta = {k: v - before[k] for k, v in counters().items()}
    assert delta == {"nanoinfer:request_success_total": 1, "nanoinfer:prompt_tokens_total": 4,
                     "nanoinfer:generation_tokens_total": 6, "nanoinfer:time_to_first_token_seconds_count": 1,
                     "nanoinfer:e2e_request_latency_seconds_count": 1, "nanoinfer:inter_token_latency_seconds_count": 5,
                     "nanoinfer:request_queue_time_seconds_count": 1,
                     "nanoinfer:prefix_cache_queries_total": delta["nanoinfer:prefix_cache_queries_total"]}
    assert delta["nanoinfer:prefix_cache_queries_total"] >= 4  # the prompt was looked up
    assert out.usage.completion_tokens == 6
    names = {name for name, _ in metric_values(server.url, AUTH)}
    for name in ("nanoinfer:num_requests_waiting", "nanoinfer:kv_cache_usage_perc", "nanoinfer:prefix_cache_hits_total",
                 "nanoinfer:num_preemptions_total"):
        assert name in names


def test_metrics_count_the_finish_reason_the_client_sees(server, client):
    """A stop string completed by the last allowed token: the client gets "stop" (vLLM's), and so does the
    request_success counter (it counted the core's "length")."""
    kw = dict(model="tiny", prompt="Once upon a time", temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(max_tokens=6, **kw).choices[0].text
    shorter = client.completions.create(max_tokens=5, **kw).choices[0].text
    stop = full[len(shorter):]
    assert stop.strip() and stop not in full[:-len(stop)]  # the 6th token's text, found nowhere earlier

    def successes() -> dict[str, float]:
        values = metric_values(server.url, AUTH)
        return {reason: values.get(("nanoinfer:request_success_total", (("finished_reason", reason),)), 0)
                for reason in ("stop", "length")}

    before = successes()
    out = client.completions.create(max_tokens=6, stop=[stop], **kw).choices[0]
    assert out.finish_reason == "stop"
    wait_for(lambda: sum(successes().values()) == sum(before.values()) + 1)
    assert successes() == {"stop": before["stop"] + 1, "length": before["length"]}


def delta(text: str, tokens: list[int], finish: str | None = None):
    """One engine delta of request r-0: `text` for the new `tokens`, each with logprob -1."""
    from nanoinfer.outputs import CompletionOutput, RequestOutput

    logprobs = [{t: Logprob(-1.0)} for t in tokens]
    return RequestOutput("r-0", None, [1, 2], [CompletionOutput(0, text, tokens, logprobs, finish)], finish is not None)


def test_output_stream_merges_deltas_for_a_slow_reader() -> None:
    """Deltas that arrive before the reader takes them come out as one, in order."""
    from nanoinfer.server.core_client import OutputStream

    async def read() -> list[dict]:
        stream = OutputStream(["r-0"])
        stream.put(delta("Hel", [5]))
        stream.put(delta("lo", [6, 7]))
        first = await stream.__anext__()
        stream.put(delta("!", [8], "stop"))
        return [first] + [updates async for updates in stream]

    first, last = asyncio.run(read())
    merged = first["r-0"].outputs[0]
    assert (merged.text, merged.token_ids, merged.logprobs) == ("Hello", [5, 6, 7], [{5: Logprob(-1.0)}, {6: Logprob(-1.0)}, {7: Logprob(-1.0)}])
    assert last["r-0"].finished and last["r-0"].outputs[0].token_ids == [8]


def test_a_token_whose_text_lags_still_gets_its_chunk() -> None:
    """As in vLLM, every new token makes a chunk, with empty text while its text is held back (an incomplete
    character, a possible stop string, an id the tokenizer cannot decode): time to first token and between
    tokens count tokens, and each token's logprobs go out when it is sampled."""
    from nanoinfer.server.serving import _DeltaTracker

    tracker = _DeltaTracker(["r-0"], 1)
    steps = [delta("", [5]), delta("", []), delta("Hello", [6, 7]), delta("!", [8], "stop"), delta("late", [9])]
    chunks = [[(d.completion.text, d.completion.token_ids, d.completion.logprobs, d.text_offset, d.first)
               for d in tracker.update({"r-0": out})]
              for out in steps]
    assert chunks == [[("", [5], [{5: Logprob(-1.0)}], 0, True)],
                      [],  # nothing new: no chunk
                      [("Hello", [6, 7], [{6: Logprob(-1.0)}, {7: Logprob(-1.0)}], 0, False)],
                      [("!", [8], [{8: Logprob(-1.0)}], 5, False)],
                      []]  # after the last chunk
    assert tracker.usage()["completion_tokens"] == 4


def test_serving_benchmark_splits_its_load_over_client_processes(server, smollm2_path, tmp_path) -> None:
    """bench/serving.py with --num-clients 2: every request sent once, on one Poisson schedule, all counted; its
    load as vllm bench serve's: arrivals rescaled to num_prompts / rate, text prompts of --input-len tokens."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("serving_bench", os.path.join(REPO_ROOT, "bench", "serving.py"))
    bench = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    args = bench.argparse.Namespace(seed=0, vocab_size=100, input_len=4, num_prompts=50, request_rate=10.0,
                                    tokenizer=None)
    prompts, warmup, offsets = bench.workload(args)
    assert len(prompts) == 50 and warmup not in prompts and all(n == 4 for _, n in prompts)
    assert offsets == sorted(offsets) and 0 < offsets[0] and offsets[-1] == pytest.approx(5.0)  # 50 / 10 req/s
    assert bench.workload(args)[2] == offsets  # the seed fixes the schedule
    text = bench.workload(bench.argparse.Namespace(**vars(args) | {"tokenizer": smollm2_path, "input_len": 64}))[0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_path)
    assert all(isinstance(p, str) and len(tokenizer.encode(p, add_special_tokens=False)) == n for p, n in text)
    assert sum(n == 64 for _, n in text) >= 45  # re-encoding keeps the length, but for a rare text
    assert bench.workload(bench.argparse.Namespace(**vars(args) | {"request_rate": float("inf")}))[2] == [0.0] * 50

    out = tmp_path / "bench.json"
    cmd = [sys.executable, "bench/serving.py", "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "6",
           "--input-len", "8", "--output-len", "5", "--request-rate", "20", "--num-clients", "2",
           "--tokenizer", smollm2_path, "--json-out", str(out)]
    subprocess.run(cmd, cwd=REPO_ROOT, check=True, capture_output=True, timeout=180)
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (6, 0, 30)
    assert result["ttft_ms"]["median"] > 0 and result["itl_ms"]["median"] > 0 and result["duration_s"] > 0


def test_core_outputs_cross_the_wire_unchanged() -> None:
    from nanoinfer.outputs import EngineCoreOutput, TokenLogprobs
    from nanoinfer.server.wire import decode_outputs, encode_outputs, pack, unpack

    lp = TokenLogprobs(5, -0.5, 1, [5, 7], [-0.5, -1.5])
    outputs = [EngineCoreOutput("a", [5], [lp], "length", None, 3, [None, lp]),
               EngineCoreOutput("b", [1, 2], [None, None], None, None, 0, [None]),  # a one-token prompt: [None]
               EngineCoreOutput("c", [], [], "abort", None, 0, None)]
    assert decode_outputs(unpack(pack(*encode_outputs(outputs)))) == outputs
