"""The embedding model's endpoints (`--runner pooling`): /v1/embeddings (and vLLM's /pooling, the same vectors),
vLLM's bi-encoder /score and /rerank, whose scores are the cosine similarities of embeddings. They admit their
texts through the generation endpoints' path (`OpenAIServing.generate` and `collect`: tokenizing off the event
loop, the waiting-queue bound, aborts when the client goes away), as requests that end with their prompt's pooled
vector."""

from __future__ import annotations

import base64
import time
from typing import Callable

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from nanoinfer.outputs import EmbeddingRequestOutput
from nanoinfer.pooling_params import PoolingParams, cosine, pair_scores, score_pairs
from nanoinfer.server.protocol import ApiError, EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest
from nanoinfer.server.serving import OpenAIServing, request_ids


class PoolingServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create_embedding(self, req: EmbeddingRequest, raw: Request, kind: str = "embedding") -> Response:
        """/v1/embeddings, or with kind "pooling" vLLM's /pooling (the same vectors, each under "data")."""
        self._check(req)
        req.check_form()
        response_id, request_id = request_ids("embd" if kind == "embedding" else "pool", raw, req.request_id)
        prompts = req.prompts if req.messages is None else lambda: [self.serving.chat_prompt(req)]
        outputs = await self._pool(request_id, prompts, req.pooling_params(req.normalize, req.dimensions), req,
                                   {"prompt": "input" if req.messages is None else "messages"}, raw)
        if outputs is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        return JSONResponse(self._pooled_base(response_id, req.model, outputs) | {
            "object": "list", "data": [{"object": kind, "index": i,
                                        "embedding" if kind == "embedding" else "data": _encode_embedding(
                                            o.outputs.embedding, req.encoding_format, req.embed_dtype, req.endianness)}
                                       for i, o in enumerate(outputs)]})

    async def create_score(self, req: ScoreRequest, raw: Request) -> Response:
        """Each pair's cosine similarity (vLLM's score for an embedding model)."""
        self._check(req)
        side_1, side_2 = req.sides()
        try:  # they pair up before anything runs
            score_pairs(len(side_1), len(side_2))
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        response_id, request_id = request_ids("score", raw, req.request_id)
        outputs = await self._pool(request_id, lambda: side_1 + side_2, req.pooling_params(), req, {}, raw)
        if outputs is None:
            return Response(status_code=499)
        vectors = [o.outputs.embedding for o in outputs]
        scores = pair_scores(vectors[: len(side_1)], vectors[len(side_1):])
        return JSONResponse(self._pooled_base(response_id, req.model, outputs) | {
            "object": "list",
            "data": [{"object": "score", "index": i, "score": score} for i, score in enumerate(scores)]})

    async def create_rerank(self, req: RerankRequest, raw: Request) -> Response:
        """The documents by their cosine similarity to the query, best first (the top_n best)."""
        self._check(req)
        response_id, request_id = request_ids("rerank", raw, req.request_id)
        outputs = await self._pool(request_id, req.prompts, req.pooling_params(), req, {"prompt": "documents"}, raw)
        if outputs is None:
            return Response(status_code=499)
        query = outputs[0].outputs.embedding
        results = sorted(({"index": i, "relevance_score": cosine(query, o.outputs.embedding)}
                          | ({"document": {"text": req.documents[i]}} if req.return_documents else {})
                          for i, o in enumerate(outputs[1:])), key=lambda r: -r["relevance_score"])
        return JSONResponse(self._pooled_base(response_id, req.model, outputs)
                            | {"results": results[: req.top_n if req.top_n and req.top_n > 0 else None]})

    async def _pool(self, request_id: str, make_prompts: Callable[[], list[str | list[int]]], params: PoolingParams,
                    req: PoolingRequest, renames: dict[str, str],
                    raw: Request) -> list[EmbeddingRequestOutput] | None:
        """The embeddings of the prompts, in order; None if the client went away first."""
        stream = await self.serving.generate(request_id, make_prompts, params, req, renames, raw)
        outputs = await self.serving.collect(stream, raw)
        if outputs is not None and not all(isinstance(o, EmbeddingRequestOutput) for o in outputs):
            raise ApiError(503, "the server is shutting down")  # aborted while draining
        return outputs

    def _check(self, req: PoolingRequest) -> None:
        self.serving.check_model(req.model)
        self.serving.check_runner(embeddings=True)

    def _pooled_base(self, response_id: str, model: str | None, outputs: list[EmbeddingRequestOutput]) -> dict:
        num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return {"id": response_id, "created": int(time.time()), "model": self.serving.response_model(model),
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def _encode_embedding(vector: list[float], encoding_format: str, embed_dtype: str, endianness: str
                      ) -> list[float] | str:
    """OpenAI's two forms: the numbers, or their bytes in base64 (the openai client asks for that by default and
    decodes native float32 with numpy); vLLM's embed_dtype and endianness choose the bytes."""
    if encoding_format == "float":
        return vector
    values = np.asarray(vector, dtype=np.float32)
    if embed_dtype == "bfloat16":  # a float32's upper half, rounded to the nearest even (as torch converts)
        bits = values.view(np.uint32)
        values = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    elif embed_dtype == "float16":
        values = values.astype(np.float16)
    order = {"native": "=", "little": "<", "big": ">"}[endianness]
    return base64.b64encode(values.astype(values.dtype.newbyteorder(order)).tobytes()).decode()
