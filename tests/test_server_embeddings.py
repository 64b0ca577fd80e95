"""/v1/embeddings end to end: a `nanoinfer serve --runner pooling` process driven by the official `openai` client,
against `LLM.embed` on the same weights; the errors of both runners' endpoints."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from nanoinfer import LLM, PoolingParams
from test_server import launch_server, tiny_model_with_smollm2_vocab

POOLER = '{"pooling_type": "MEAN"}'
TEXTS = ["The capital of France is", "Embeddings map text to vectors.", "a"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return tiny_model_with_smollm2_vocab(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_path, smollm2_path, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("embedding_server_log") / "server.log")
    srv = launch_server(log, model_path, "--tokenizer", smollm2_path, "--runner", "pooling", "--pooler-config", POOLER,
                        "--served-model-name", "embedder", "--max-model-len", "64",
                        "--allowed-origins", '["https://app.example"]', "--allowed-methods", '["POST"]')
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def offline(model_path, smollm2_path) -> LLM:
    return LLM(model_path, tokenizer=smollm2_path, runner="pooling", pooler_config={"pooling_type": "MEAN"},
               max_model_len=64, device="cpu")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_embeddings_match_offline_in_both_encodings(client, offline):
    expected = [o.outputs.embedding for o in offline.embed(TEXTS, use_tqdm=False)]
    for encoding in ({}, {"encoding_format": "float"}):  # unless told, the client asks for base64 and decodes it
        response = client.embeddings.create(model="embedder", input=TEXTS, **encoding)
        assert [d.index for d in response.data] == [0, 1, 2] and response.model == "embedder"
        for got, want in zip(response.data, expected):
            assert np.allclose(got.embedding, want, atol=1e-6) and np.isclose(np.linalg.norm(got.embedding), 1.0)
        prompt_tokens = sum(len(offline.tokenizer.encode(t)) for t in TEXTS)
        assert response.usage.prompt_tokens == response.usage.total_tokens == prompt_tokens
    ids = offline.tokenizer.encode(TEXTS[0])
    by_ids = client.embeddings.create(model="embedder", input=[ids], encoding_format="float").data[0].embedding
    assert np.allclose(by_ids, expected[0], atol=1e-6)
    messages = [{"role": "user", "content": "Embed me."}]
    chat = httpx.post(f"{client.base_url}embeddings", json={"messages": messages}).json()["data"][0]["embedding"]
    rendered = offline.apply_chat_template(messages, add_generation_prompt=False)
    assert np.allclose(chat, offline.embed([rendered], use_tqdm=False)[0].outputs.embedding, atol=1e-6)
    for dtype, endianness, decoded in [("float16", "little", "<f2"), ("float32", "big", ">f4"),
                                       ("bfloat16", "big", None)]:
        body = {"input": TEXTS[0], "encoding_format": "base64", "embed_dtype": dtype, "endianness": endianness}
        data = base64.b64decode(httpx.post(f"{client.base_url}embeddings", json=body).json()["data"][0]["embedding"])
        if decoded is None:  # bfloat16: a float32's upper half, rounded as torch rounds
            bf16 = torch.tensor(expected[0]).to(torch.bfloat16).view(torch.int16).numpy().astype(">i2").tobytes()
            assert data == bf16
        else:
            assert np.array_equal(np.frombuffer(data, decoded), np.asarray(expected[0], np.float32).astype(decoded))
    pooled = httpx.post(f"{client.base_url.copy_with(path='/pooling')}", json={"input": TEXTS[:2]}).json()
    assert pooled["object"] == "list" and pooled["id"].startswith("pool-")  # vLLM's /pooling: the same vectors
    assert [d["object"] for d in pooled["data"]] == ["pooling", "pooling"] and pooled["usage"]["prompt_tokens"] > 0
    assert all(np.allclose(d["data"], want, atol=1e-6) for d, want in zip(pooled["data"], expected))
    raw = httpx.post(f"{client.base_url}embeddings", json={"input": TEXTS[1], "normalize": False}).json()
    want = offline.embed(TEXTS[1:2], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.embedding
    assert np.allclose(raw["data"][0]["embedding"], want, atol=1e-6)


@pytest.mark.parametrize("body, status, param, message", [
    ({"input": []}, 400, "input", "input is empty"),
    ({}, 400, "input", "give input (texts or token ids) or messages"),
    ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "input", "one of the two"),
    ({"input": [1, "a"]}, 400, "input", "input must be a string"),
    ({"input": "x", "dimensions": 8}, 400, "dimensions", "dimensions is not supported by this model"),
    ({"input": "x", "dimensions": 0}, 400, "dimensions", "dimensions must be at least 1"),
    ({"input": "x", "encoding_format": "hex"}, 400, "encoding_format", "'float' or 'base64'"),
    ({"input": "x", "embed_dtype": "fp8_e4m3"}, 400, "embed_dtype", "'float32', 'float16' or 'bfloat16'"),
    ({"input": [5] * 65}, 400, "input", "prompt has 65 tokens; max_model_len allows at most 64"),
    ({"input": "x", "model": "gpt"}, 404, "model", "does not exist"),
])
def test_bad_embedding_requests(server, body, status, param, message):
    response = httpx.post(f"{server.url}/v1/embeddings", json=body)
    error = response.json()["error"]
    assert response.status_code == status and error["param"] == param and message in error["message"], error


def test_score_and_rerank_match_offline_cosines(server, offline):
    query, documents = "Where is Paris?", ["Paris is in France.", "Bananas are yellow.", "France's capital."]
    vectors = [np.array(o.outputs.embedding) for o in offline.embed([query, *documents], use_tqdm=False)]
    cosines = [float(vectors[0] @ v) for v in vectors[1:]]  # unit vectors
    for path, fields in (("/score", {"queries": query, "documents": documents}),
                         ("/v1/score", {"text_1": query, "text_2": documents}),
                         ("/v1/score", {"data_1": query, "data_2": documents}),
                         ("/score", {"queries": query, "items": documents})):
        data = httpx.post(f"{server.url}{path}", json=fields).json()["data"]
        assert [d["index"] for d in data] == [0, 1, 2] and np.allclose([d["score"] for d in data], cosines, atol=1e-6)
    order = sorted(range(3), key=lambda i: -cosines[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        reply = httpx.post(f"{server.url}{path}", json={"query": query, "documents": documents, "top_n": 2}).json()
        assert [r["index"] for r in reply["results"]] == order[:2]
        assert np.allclose([r["relevance_score"] for r in reply["results"]], [cosines[i] for i in order[:2]], atol=1e-6)
        assert [r["document"]["text"] for r in reply["results"]] == [documents[i] for i in order[:2]]
        assert reply["usage"]["total_tokens"] == sum(len(offline.tokenizer.encode(t)) for t in [query, *documents])
        every = httpx.post(f"{server.url}{path}", json={"query": query, "documents": documents, "top_n": -1}).json()
        assert [r["index"] for r in every["results"]] == order  # top_n <= 0: all, as vLLM's
    bad = [("/score", {"queries": ["a", "b"], "documents": ["c", "d", "e"]}, "has 2 texts and the second 3"),
           ("/score", {"queries": "a", "text_2": "b"}, "give one pair of queries and documents / queries and items"),
           ("/rerank", {"query": "a", "documents": []}, "documents is empty")]
    for path, body, message in bad:
        response = httpx.post(f"{server.url}{path}", json=body)
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text


def test_a_pooling_server_generates_nothing(server, client):
    with pytest.raises(openai.NotFoundError, match="it serves /v1/embeddings"):
        client.completions.create(model="embedder", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="it serves /v1/embeddings"):
        client.chat.completions.create(model="embedder", messages=[{"role": "user", "content": "hi"}])
    assert httpx.get(f"{server.url}/health").status_code == 200



def test_cors_takes_the_origins_and_methods_it_is_given(server):
    """--allowed-origins / --allowed-methods (JSON lists, as vLLM's): other origins and methods get no grant."""
    def preflight(origin: str, method: str) -> httpx.Response:
        return httpx.options(f"{server.url}/v1/embeddings", headers={"Origin": origin,
                                                                       "Access-Control-Request-Method": method})
    granted = preflight("https://app.example", "POST")
    assert granted.status_code == 200 and granted.headers["access-control-allow-origin"] == "https://app.example"
    assert preflight("https://other.example", "POST").status_code == 400
    assert preflight("https://app.example", "DELETE").status_code == 400
    response = httpx.get(f"{server.url}/v1/models", headers={"Origin": "https://other.example"})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers
