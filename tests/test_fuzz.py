"""API fuzzing: schemathesis drives every operation of the server's own
/openapi.json (bounded number of examples), and a hand-written list of hostile
bodies (huge, deeply nested, wrong types, NaN / Infinity, unicode edge cases,
`n`, `max_tokens` and `logprobs` at and beyond their limits) must each get the
documented 4xx or a complete answer: never a 5xx, a hang or a traceback."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import APIOperation, GenerationMode
from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                 response_schema_conformance, status_code_conformance)

from test_server import launch_server, metric_values, tiny_model_with_smollm2_vocab, wait_for

API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 128
MAX_OUTPUT_TOKENS = 256  # n x max_tokens x prompts
MAX_BODY = 1 << 20
FUZZ_EXAMPLES = 40  # per operation
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_path):
    """With LoRA adapters loadable at run time: every operation is fuzzed, the two adapter endpoints too."""
    model = tiny_model_with_smollm2_vocab(tmp_path_factory)
    log = str(tmp_path_factory.mktemp("fuzz_log") / "server.log")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
        srv = launch_server(log, model, "--tokenizer", smollm2_path, "--api-key", API_KEY, "--served-model-name",
                            "tiny", "--max-model-len", str(MAX_MODEL_LEN), "--max-output-tokens-per-request",
                            str(MAX_OUTPUT_TOKENS), "--max-request-body-bytes", str(MAX_BODY), "--log-stats-interval",
                            "0", "--enable-lora")
    yield srv
    assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log()


def _operations() -> dict[str, APIOperation]:
    """The server's operations, from the schema it serves (built here without a server, to parametrize)."""
    from nanoinfer.server.api_server import ServeOptions, build_app

    spec = build_app(None, None, ServeOptions(api_key=API_KEY), lora_updating=True).openapi()
    return {op.label: op for op in (result.ok() for result in schemathesis.openapi.from_dict(spec).get_all_operations())}


OPERATIONS = _operations()
FUZZ_CASES: dict[str, int] = {}


def test_served_schema_is_the_one_fuzzed(server):
    served = httpx.get(f"{server.url}/openapi.json", headers=AUTH).json()
    assert sorted(f"{m.upper()} {p}" for p, item in served["paths"].items() for m in item) == sorted(OPERATIONS)
    assert len(OPERATIONS) == 19


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_openapi_fuzz(server, label, mode):
    """Random bodies from the schema (positive) and bodies that break it (negative): every response
    is documented, matches its schema, is never a 5xx, and a body that breaks the schema is refused."""
    operation = OPERATIONS[label]
    if mode == GenerationMode.NEGATIVE and not len(operation.body):
        pytest.skip("no body and no parameters (the GETs, POST /ping): nothing to break")

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case) -> None:
        FUZZ_CASES[f"{label} {mode.value}"] = FUZZ_CASES.get(f"{label} {mode.value}", 0) + 1
        case.call_and_validate(base_url=server.url, headers=AUTH, checks=CHECKS, timeout=60)

    fuzz()


def test_fuzz_left_the_server_clean(server):
    """After the fuzzing (this file's earlier tests): no block held, healthy, nothing logged as a 500."""
    wait_for(lambda: metric_values(server.url, AUTH)[("nanoinfer:kv_cache_blocks_in_use", ())] == 0, what="idle")
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "internal error" not in server.log()
    print(f"schemathesis cases: {sum(FUZZ_CASES.values())}, per operation and mode: {FUZZ_CASES}")


# ----- hostile bodies -----

OK = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


HOSTILE = [  # (id, path, JSON body or raw bytes, expected status)
    ("body-over-limit", "/v1/completions", OK | {"prompt": "a" * MAX_BODY}, 413),
    ("prompt-over-context", "/v1/completions", OK | {"prompt": "hello " * 5000}, 400),
    ("token-prompt-over-context", "/v1/completions", OK | {"prompt": [1] * 10_000}, 400),
    ("many-prompts-over-limit", "/v1/completions", OK | {"prompt": [[1]] * 20_000}, 400),
    ("deep-json", "/v1/completions", _nested(100_000), 400),
    ("deep-json-chat", "/v1/chat/completions", b'{"messages": [' + b"{" * 50_000 + b"]}", 400),
    ("deep-json-tokenize", "/tokenize", _nested(10_000), 400),
    ("not-an-object", "/v1/completions", [OK], 400),
    ("prompt-int", "/v1/completions", OK | {"prompt": 5}, 400),
    ("prompt-mixed-list", "/v1/completions", OK | {"prompt": ["a", [1]]}, 400),
    ("prompt-bool-ids", "/v1/completions", OK | {"prompt": [True, False]}, 400),
    ("prompt-float-ids", "/v1/completions", OK | {"prompt": [1.5]}, 400),
    ("negative-token-id", "/v1/completions", OK | {"prompt": [-1]}, 400),
    ("messages-object", "/v1/chat/completions", CHAT | {"messages": {"role": "user"}}, 400),
    ("message-content-int", "/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": 3}]}, 400),
    ("image-part", "/v1/chat/completions",
     CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "file:///etc/passwd"}]}]}, 400),
    ("n-string", "/v1/completions", OK | {"n": "two"}, 400),
    ("n-float", "/v1/completions", OK | {"n": 1.5}, 400),
    ("stream-string", "/v1/completions", OK | {"stream": "maybe"}, 400),
    ("stop-int", "/v1/completions", OK | {"stop": 5}, 400),
    ("stop-empty", "/v1/completions", OK | {"stop": [""]}, 400),
    ("temperature-nan", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400),
    ("top-p-infinity", "/v1/completions", b'{"prompt": "hi", "top_p": Infinity}', 400),
    ("penalty-minus-infinity", "/v1/completions", b'{"prompt": "hi", "presence_penalty": -Infinity}', 400),
    ("max-tokens-nan", "/v1/completions", b'{"prompt": "hi", "max_tokens": NaN}', 400),
    ("max-tokens-1e400", "/v1/completions", b'{"prompt": "hi", "max_tokens": 1e400}', 400),
    ("token-id-nan", "/v1/completions", b'{"prompt": [1, NaN]}', 400),
    ("lone-surrogate-prompt", "/v1/completions", b'{"prompt": "hi \\ud800 there"}', 400),
    ("lone-surrogate-stop", "/v1/completions", b'{"prompt": "hi", "stop": ["\\udfff"]}', 400),
    ("lone-surrogate-chat", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', 400),
    ("lone-surrogate-tokenize", "/tokenize", b'{"prompt": "\\ud800"}', 400),
    ("lone-surrogate-salt", "/v1/completions", b'{"prompt": "hi", "cache_salt": "\\ud800"}', 400),
    ("raw-surrogate-bytes", "/v1/completions", b'{"prompt": "\xed\xa0\x80"}', 400),
    ("invalid-utf8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400),
    ("utf16-body", "/v1/completions", json.dumps(OK).encode("utf-16"), 200),  # json.loads detects UTF-16 and -32
    ("unicode-edge-cases", "/v1/completions",
     OK | {"prompt": "\u0000\u200b\u202e\ufeff e\u0301 \U0001F469\u200d\U0001F469\u200d\U0001F467 \U0010FFFF \ufffd"}, 200),
    ("unicode-stop-and-salt", "/v1/completions", OK | {"stop": ["\U0001F600", "\u0000"], "cache_salt": "\u202e\U0001F600"}, 200),
    ("n-zero", "/v1/completions", OK | {"n": 0}, 400),
    ("n-negative", "/v1/completions", OK | {"n": -1}, 400),
    ("n-at-limit", "/v1/completions", OK | {"n": MAX_OUTPUT_TOKENS // 2}, 200),
    ("n-beyond-limit", "/v1/completions", OK | {"n": MAX_OUTPUT_TOKENS // 2 + 1}, 400),
    ("n-huge", "/v1/completions", OK | {"n": 10**9, "max_tokens": 1}, 400),
    ("n-2-to-64", "/v1/completions", OK | {"n": 2**64}, 400),
    ("max-tokens-zero", "/v1/completions", OK | {"max_tokens": 0}, 400),
    ("max-tokens-at-context", "/v1/completions", OK | {"prompt": [1], "max_tokens": MAX_MODEL_LEN - 1}, 200),
    ("max-tokens-beyond-context", "/v1/completions", OK | {"prompt": [1], "max_tokens": MAX_MODEL_LEN}, 400),
    ("max-tokens-2-to-63", "/v1/completions", OK | {"max_tokens": 2**63}, 400),
    ("max-tokens-2-to-100", "/v1/completions", OK | {"max_tokens": 2**100}, 400),
    ("logprobs-at-max", "/v1/completions", OK | {"logprobs": 20}, 200),
    ("logprobs-beyond-max", "/v1/completions", OK | {"logprobs": 21}, 400),
    ("logprobs-negative", "/v1/completions", OK | {"logprobs": -1}, 400),
    ("top-logprobs-at-max", "/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 20}, 200),
    ("top-logprobs-beyond-max", "/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 21}, 400),
    ("seed-2-to-64", "/v1/completions", OK | {"seed": 2**64}, 400),
    ("priority-2-to-64", "/v1/completions", OK | {"priority": 2**64}, 400),
    ("priority-minus-2-to-70", "/v1/completions", OK | {"priority": -(2**70)}, 400),
    ("top-k-2-to-70", "/v1/completions", OK | {"top_k": 2**70}, 400),
    ("stop-token-id-2-to-70", "/v1/completions", OK | {"stop_token_ids": [2**70]}, 400),
    ("stop-token-id-outside-vocab", "/v1/completions", OK | {"stop_token_ids": [10**9]}, 400),
    ("detokenize-2-to-70", "/detokenize", {"tokens": [2**70]}, 400),
    ("many-stop-strings", "/v1/completions", OK | {"stop": ["x" * 1000] * 128}, 200),
    ("too-many-stop-strings", "/v1/completions", OK | {"stop": ["x" * 1000] * 129}, 400),
    ("repeated-stop-token-ids", "/v1/completions", OK | {"n": 32, "stop_token_ids": [1] * 100_000}, 200),
    ("too-many-stop-token-ids", "/v1/completions", OK | {"stop_token_ids": list(range(1025))}, 400),
    ("lora-path-a-file", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc/passwd"}, 400),
    ("lora-path-a-folder", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}, 400),
    ("lora-path-traversal", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "../../../../dev"}, 400),
    ("lora-path-nul", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp\u0000/x"}, 400),
    ("lora-name-the-base", "/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": "/tmp"}, 400),
    ("unload-unknown-lora", "/v1/unload_lora_adapter", {"lora_name": "x"}, 404),
    ("lora-model-unknown", "/v1/completions", OK | {"model": "x"}, 404),
]


@pytest.mark.parametrize("path,body,status", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_body(server, path, body, status):
    kw = {"content": body} if isinstance(body, bytes) else {"content": json.dumps(body)}
    start = time.monotonic()
    response = httpx.post(f"{server.url}{path}", headers=AUTH | {"Content-Type": "application/json"}, timeout=60, **kw)
    assert response.status_code == status, response.text[:500]
    assert time.monotonic() - start < 10
    if status != 200:
        error = response.json()["error"]
        assert error["code"] == status and error["message"] and "Traceback" not in error["message"]
    else:
        choices = response.json()["choices"]
        assert choices and all(c["finish_reason"] in ("stop", "length") for c in choices)
