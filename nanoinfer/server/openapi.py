"""A truthful /openapi.json. The routes read their bodies themselves (the size
limit is enforced before parsing), so FastAPI sees neither the request bodies
nor the errors: this declares each operation's body (the pydantic models'
JSON schemas), its success content types, and every error status it can
answer, in the `{"error": {...}}` shape."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from nanoinfer.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                                       LoadLoRAAdapterRequest, RerankRequest, ScoreRequest, TokenizeRequest,
                                       UnloadLoRAAdapterRequest)

_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}},
}
_JSON = {"application/json": {"schema": {"type": "object"}}}
# Before OpenAPI 3.2 (`itemSchema`), an event stream's `schema` describes each event, as schemathesis reads it.
_STREAM = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk of the response; the last event is [DONE]"}}}}}
_TEXT = {"text/plain": {"schema": {"type": "string"}}}
_DESCRIPTIONS = {200: "OK", 400: "invalid request", 401: "missing or wrong API key",
                 404: "unknown model or LoRA adapter, or an endpoint of the other runner (text / embeddings)",
                 413: "request body too large", 500: "the request failed inside the engine (see the server log)",
                 503: "waiting queue full, shutting down, or engine core dead"}
# path -> (request body, content of a 200, error statuses besides 401)
_OPERATIONS: dict[str, tuple[type[BaseModel] | None, dict | None, tuple[int, ...]]] = {
    "/health": (None, None, (503,)),
    "/ping": (None, None, (503,)),
    "/version": (None, _JSON, ()),
    "/v1/models": (None, _JSON, ()),
    "/metrics": (None, _TEXT, ()),
    "/tokenize": (TokenizeRequest, _JSON, (400, 404, 413)),
    "/detokenize": (DetokenizeRequest, _JSON, (400, 404, 413)),
    "/v1/completions": (CompletionRequest, _JSON | _STREAM, (400, 404, 413, 500, 503)),
    "/v1/chat/completions": (ChatCompletionRequest, _JSON | _STREAM, (400, 404, 413, 500, 503)),
    **{path: (EmbeddingRequest, _JSON, (400, 404, 413, 503)) for path in ("/v1/embeddings", "/pooling")},
    **{path: (ScoreRequest, _JSON, (400, 404, 413, 503)) for path in ("/score", "/v1/score")},
    **{path: (RerankRequest, _JSON, (400, 404, 413, 503)) for path in ("/rerank", "/v1/rerank", "/v2/rerank")},
    "/v1/load_lora_adapter": (LoadLoRAAdapterRequest, _TEXT, (400, 413)),
    "/v1/unload_lora_adapter": (UnloadLoRAAdapterRequest, _TEXT, (400, 404, 413)),
}


def document_api(app: FastAPI, public_paths: tuple[str, ...]) -> None:
    """Replace the app's generated schema; `public_paths` need no API key (no 401)."""

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["ErrorResponse"] = _ERROR
        for path, item in schema["paths"].items():
            body, content, errors = _OPERATIONS[path]
            statuses = errors if path in public_paths else (401, *errors)
            for operation in item.values():
                responses = {"200": {"description": "OK"} | ({"content": content} if content else {})}
                for status in sorted(statuses):
                    responses[str(status)] = {"description": _DESCRIPTIONS[status], "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
                operation["responses"] = responses
                if body is not None:
                    model_schema = body.model_json_schema(ref_template="#/components/schemas/{model}")
                    definitions = model_schema.pop("$defs", {})
                    for model in (model_schema, *definitions.values()):
                        _optional_fields_take_null(model)
                    components.update(definitions)
                    components[body.__name__] = model_schema
                    operation["requestBody"] = {"required": True, "content": {"application/json": {
                        "schema": {"$ref": f"#/components/schemas/{body.__name__}"}}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


def _optional_fields_take_null(model: dict) -> None:
    """An explicit null in a body means the field's default (protocol._Body, as OpenAI's nullable fields): every
    field a body may leave out takes null too."""
    required = set(model.get("required", ()))
    for name, field in model.get("properties", {}).items():
        typed = "type" in field or "anyOf" in field or "$ref" in field  # (an untyped field takes null already)
        if name in required or not typed or any(option.get("type") == "null" for option in field.get("anyOf", ())):
            continue
        kept = {key: field.pop(key) for key in ("default", "title", "description") if key in field}
        model["properties"][name] = {"anyOf": [field, {"type": "null"}], **kept}
