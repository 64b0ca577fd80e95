"""Isolation and access: the API key guards every endpoint but /health (and
/metrics with --metrics-without-auth) and is compared in constant time;
cache_salt keeps one tenant's prefix cache out of another's reach; no request
field makes the server read a client-supplied path; prompts reach the logs
only with --log-prompts."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from test_server import launch_server, metric_values, tiny_model_with_smollm2_vocab

API_KEY = "isolation-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PASSWD_LINE = "root:x:0:0"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return tiny_model_with_smollm2_vocab(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_path, smollm2_path, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("isolation_log") / "server.log")
    srv = launch_server(log, model_path, "--tokenizer", smollm2_path, "--api-key", API_KEY, "--served-model-name",
                        "tiny", "--metrics-without-auth")
    yield srv
    assert srv.stop() == 0, srv.log()


# ----- the API key -----


def test_every_endpoint_but_health_ping_and_metrics_needs_the_key(server):
    schema = httpx.get(f"{server.url}/openapi.json", headers=AUTH).json()
    operations = [(method.upper(), path) for path, item in schema["paths"].items() for method in item]
    assert len(operations) == 17
    operations += [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/nothing-here"),
                   ("POST", "/v1/completions/../../etc/passwd"), ("DELETE", "/v1/models")]
    wrong = [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": f"Bearer {API_KEY}x"},
             {"Authorization": f"Bearer {API_KEY[:-1]}"}, {"Authorization": API_KEY},
             {"Authorization": f"bearer {API_KEY}"}, {"Authorization": f"Basic {API_KEY}"},
             {"X-API-Key": API_KEY}]
    for method, path in operations:
        for headers in wrong:
            response = httpx.request(method, f"{server.url}{path}", headers=headers, json={"prompt": "hi"})
            expected = 200 if path in ("/health", "/ping", "/metrics") else 401
            assert response.status_code == expected, (method, path, headers, response.text)
            if expected == 401:
                assert response.json()["error"]["type"] == "authentication_error"
        assert httpx.request(method, f"{server.url}{path}", headers=AUTH, json={"prompt": "hi"}).status_code != 401
    responses = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert "401" in responses and "401" not in schema["paths"]["/health"]["get"]["responses"]
    assert "401" not in schema["paths"]["/metrics"]["get"]["responses"]


def test_api_key_is_compared_in_constant_time(monkeypatch):
    """Every check goes through hmac.compare_digest, with the whole header against the whole expected value."""
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from nanoinfer.server import api_server

    calls = []

    def spy(given, expected):
        calls.append((given, expected))
        return given == expected

    monkeypatch.setattr(api_server.hmac, "compare_digest", spy)
    app = FastAPI()
    app.get("/v1/models")(lambda: {"data": []})
    app.add_middleware(api_server.ApiKeyMiddleware, api_key="s3cret", public_paths=("/health",))
    client = TestClient(app)
    assert client.get("/v1/models", headers={"Authorization": "Bearer guess"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert calls == [(b"Bearer guess", b"Bearer s3cret"), (b"Bearer s3cret", b"Bearer s3cret")]


# ----- the prefix cache per tenant -----


def test_cache_salt_isolates_the_prefix_cache(server):
    prompt = list(range(1000, 1050))  # 3 full blocks of 16, unique to this test

    def cached_tokens(salt: str | None) -> int:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1} | ({"cache_salt": salt} if salt else {})
        response = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    hits_before = metric_values(server.url)[("nanoinfer:prefix_cache_hits_total", ())]
    assert cached_tokens("tenant-a") == 0
    assert cached_tokens("tenant-b") == 0  # same prompt, other tenant: no hit
    assert cached_tokens(None) == 0  # nor without a salt
    assert cached_tokens("tenant-a") == 48 and cached_tokens("tenant-b") == 48 and cached_tokens(None) == 48
    assert cached_tokens("tenant-a-") == 0 and cached_tokens("Tenant-a") == 0
    assert metric_values(server.url)[("nanoinfer:prefix_cache_hits_total", ())] - hits_before == 3 * 48


# ----- no file from a client-supplied path -----


TRAVERSALS = ["../../etc/passwd", "/etc/passwd", "file:///etc/passwd", "..\\..\\etc\\passwd", "%2e%2e%2fetc%2fpasswd"]


@pytest.mark.parametrize("name", TRAVERSALS)
def test_model_names_are_never_paths(server, name):
    messages = [{"role": "user", "content": "hi"}]
    for path, body in [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": messages}),
                       ("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})]:
        response = httpx.post(f"{server.url}{path}", headers=AUTH, json=body | {"model": name, "max_tokens": 1})
        assert response.status_code == 404 and response.json()["error"]["param"] == "model"
        assert PASSWD_LINE not in response.text


def test_path_fields_are_ignored_and_urls_do_not_escape(server):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 6, "temperature": 0}
    plain = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json=body).json()["choices"][0]["text"]
    hostile = {"tokenizer": "../../etc/passwd", "chat_template": "{% include '/etc/passwd' %}",
               "download_dir": "/etc", "lora_request": {"path": "/etc/passwd"}}
    response = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json=body | hostile)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == plain
    # A grammar is its text, never a file: this one is not EBNF.
    response = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json=body | {"guided_grammar": "/etc/passwd"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "guided_grammar"
    assert PASSWD_LINE not in response.text
    # A request's own chat template needs --trust-request-chat-template: a 400 here, as vLLM's.
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template": "{% include '/etc/passwd' %}"}
    response = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, json=chat)
    assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in response.text and PASSWD_LINE not in response.text
    for path in ["/../../etc/passwd", "/v1/../../../etc/passwd", "/v1/models/..%2f..%2fetc%2fpasswd",
                 "/static/../../etc/passwd", "/docs/../../etc/passwd", "//etc/passwd"]:
        response = httpx.get(f"{server.url}{path}", headers=AUTH)
        assert response.status_code == 404 and PASSWD_LINE not in response.text, path


def test_a_trusted_request_template_renders_that_request_alone(model_path, smollm2_path, tmp_path):
    """With --trust-request-chat-template a request's own template (Jinja text, never a path) renders its
    conversation, and only its own: the next request gets the model's template. The sandbox has no loader, so an
    include is an error, not a file."""
    server = launch_server(str(tmp_path / "server.log"), model_path, "--tokenizer", smollm2_path,
                           "--trust-request-chat-template")
    try:
        messages = [{"role": "user", "content": "hi"}]
        own = {"messages": messages, "chat_template": "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"}
        plain = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
        tokens = httpx.post(f"{server.url}/tokenize", json=own).json()["tokens"]
        assert httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()["prompt"] == "<hi>"
        assert httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"] == plain != tokens
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=own | {"max_tokens": 2, "echo": False})
        assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len(tokens)
        for template, param, words in [("{% include '/etc/passwd' %}", "messages", "rejected the messages"),
                                       ("{% for m in messages %}", "chat_template", "syntax error"),
                                       ("{{ 'hello ' * 3000000 }}", "messages", "characters long")]:
            response = httpx.post(f"{server.url}/v1/chat/completions", json=own | {"chat_template": template})
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
            assert words in response.text and PASSWD_LINE not in response.text
        # Text without a Jinja tag is a template that writes itself, never a path.
        literal = httpx.post(f"{server.url}/tokenize", json=own | {"chat_template": "/etc/passwd"}).json()["tokens"]
        assert httpx.post(f"{server.url}/detokenize", json={"tokens": literal}).json()["prompt"] == "/etc/passwd"
    finally:
        assert server.stop() == 0, server.log()


# ----- prompts in the logs -----


def _send_marked_requests(url: str, marker: str) -> None:
    """The marker in every place a prompt can be: completions (streamed or not), chat, /tokenize, a refused request."""

    async def run() -> None:
        async with httpx.AsyncClient(headers=AUTH, timeout=60) as http:
            bodies = [("/v1/completions", {"prompt": f"{marker} completion", "max_tokens": 2}),
                      ("/v1/completions", {"prompt": f"{marker} stream", "max_tokens": 2, "stream": True}),
                      ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"{marker} chat"}],
                                                "max_tokens": 2}),
                      ("/tokenize", {"prompt": f"{marker} tokenize"}),
                      ("/v1/completions", {"prompt": f"{marker} refused " * 400, "max_tokens": 2}),
                      ("/v1/completions", {"prompt": f"{marker} bad", "temperature": -1})]
            statuses = [(await http.post(url + path, json=body)).status_code for path, body in bodies]
            assert statuses == [200, 200, 200, 200, 400, 400]

    asyncio.run(run())


def test_logs_hold_no_prompts_by_default(server):
    marker = f"SECRET-{uuid.uuid4().hex}"
    _send_marked_requests(server.url, marker)
    log = server.log()
    assert log and marker not in log and "SECRET-" not in log


def test_log_prompts_flag_logs_them(model_path, smollm2_path, tmp_path):
    server = launch_server(str(tmp_path / "server.log"), model_path, "--tokenizer", smollm2_path, "--api-key",
                           API_KEY, "--log-prompts")
    try:
        marker = f"SECRET-{uuid.uuid4().hex}"
        _send_marked_requests(server.url, marker)
        log = server.log()
        for where in ("completion", "stream", "chat"):
            assert f"{marker} {where}" in log
    finally:
        assert server.stop() == 0
