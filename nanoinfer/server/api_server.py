"""The HTTP front end: FastAPI routes, API-key check, errors in OpenAI's
shape (never a traceback), and a uvicorn server that drains on SIGTERM.

Process layout: this process does HTTP, tokenization, chat templates and
detokenization; the engine core runs in a child process (see core_process)."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import signal
import socket
import time
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from nanoinfer import __version__
from nanoinfer.config import EngineConfig
from nanoinfer.engine.core import EngineDeadError
from nanoinfer.server.core_client import CoreClient
from nanoinfer.server.cli import LoRAModulePath
from nanoinfer.server.metrics import ServerMetrics
from nanoinfer.server.models import OpenAIServingModels, runtime_lora_updating
from nanoinfer.server.openapi import document_api
from nanoinfer.server.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       EmbeddingRequest, LoadLoRAAdapterRequest, RerankRequest, ScoreRequest,
                                       TokenizeRequest, UnloadLoRAAdapterRequest, parse_body)
from nanoinfer.server.pooling import PoolingServing
from nanoinfer.server.serving import OpenAIServing
from nanoinfer.server.tool_calls import TOOL_CALL_PARSERS

logger = logging.getLogger("nanoinfer")

_UVICORN_GRACE_SECONDS = 5  # after draining, for responses still being written


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ("nanoinfer",)
    max_request_body_bytes: int = 4 << 20
    max_output_tokens_per_request: int | None = 1 << 20
    shutdown_timeout: float = 30.0
    log_stats_interval: float = 5.0
    access_log: bool = True
    uvicorn_log_level: str = "info"
    metrics_without_auth: bool = False
    log_prompts: bool = False
    enable_auto_tool_choice: bool = False  # tool_choice "auto", its replies read by tool_call_parser
    tool_call_parser: str | None = None
    trust_request_chat_template: bool = False  # a request's chat_template is rendered (otherwise a 400)
    # CORS, as vLLM's defaults: browser pages of any origin may call the server (with the API key, if one is set)
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    lora_modules: tuple[LoRAModulePath, ...] = ()  # adapters served from the start (engine's enable_lora)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes}")
        if self.max_output_tokens_per_request is not None and self.max_output_tokens_per_request < 1:
            raise ValueError(f"max_output_tokens_per_request must be >= 1, got {self.max_output_tokens_per_request}")
        if not self.shutdown_timeout >= 0:  # also refuses NaN
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if not 0 <= self.log_stats_interval < math.inf:
            raise ValueError(f"log_stats_interval must be finite and >= 0 seconds (0 = off), got {self.log_stats_interval}")
        if self.api_key == "":
            raise ValueError("api_key is empty: omit it to serve without a key")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (the model's tool call format, "
                             f"one of {sorted(TOOL_CALL_PARSERS)})")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"{name} must be a list of non-empty strings, got {value!r}")
        names = self.served_model_names
        if not names or not all(isinstance(n, str) and n.strip() for n in names) or len(set(names)) != len(names):
            raise ValueError(f"served_model_names must be distinct non-empty names, got {list(names)}")


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class ApiKeyMiddleware:
    """Every path but `public_paths` needs `Authorization: Bearer <key>` (pure ASGI, so streams pass untouched)."""

    def __init__(self, app, api_key: str, public_paths: tuple[str, ...]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.public_paths = public_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.public_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'")
                return await error_response(error)(scope, receive, send)
        await self.app(scope, receive, send)


async def read_json(raw: Request, limit: int) -> object:
    """The body as JSON, refusing bodies over `limit` bytes before reading them when the length is declared."""
    too_large = ApiError(413, f"the request body exceeds {limit} bytes")
    declared = raw.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    try:
        async for chunk in raw.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:  # the client left mid-upload: nobody reads the answer, nothing to log
        raise ApiError(400, "the client disconnected before sending the whole body") from None
    raw.state.body_size = len(body)  # large bodies are tokenized off the event loop (OpenAIServing._tokenizing)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if b"\\u" in body or b"\xed" in body:  # a lone surrogate ("\\ud800") is no text: the tokenizer would choke
        try:
            json.dumps(data, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ApiError(400, "the request body holds a lone UTF-16 surrogate, which is not valid Unicode") from None
    return data


def build_app(client: CoreClient, serving: OpenAIServing, options: ServeOptions,
              lora_updating: bool = False) -> FastAPI:
    """`lora_updating`: serve /v1/load_lora_adapter and /v1/unload_lora_adapter (`runtime_lora_updating`)."""
    app = FastAPI(title="nanoinfer", version=__version__)
    public_paths = ("/health", "/ping") + (("/metrics",) if options.metrics_without_auth else ())
    if options.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=options.api_key, public_paths=public_paths)
    # Added last, so outermost: it answers preflight requests itself (they carry no key) and marks every
    # response, a 401 too, as readable by the allowed origins.
    app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                       allow_methods=list(options.allowed_methods), allow_headers=list(options.allowed_headers),
                       allow_credentials=options.allow_credentials)
    limit = options.max_request_body_bytes
    pooling = PoolingServing(serving)  # the embedding model's endpoints

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_, e: EngineDeadError) -> JSONResponse:
        return error_response(ApiError(503, str(e)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException) -> JSONResponse:
        return error_response(ApiError(e.status_code, str(e.detail), headers=e.headers))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError) -> JSONResponse:
        return error_response(ApiError(400, str(e)))

    @app.exception_handler(Exception)
    async def _internal_error(_, e: Exception) -> JSONResponse:
        logger.error("internal error: %s: %s", type(e).__name__, e, exc_info=e)
        return error_response(ApiError(500, f"internal server error ({type(e).__name__})"))

    @app.get("/health")
    @app.get("/ping")  # vLLM's (SageMaker's) name for the same check, both methods
    @app.post("/ping")
    async def health() -> Response:
        client.check_alive()
        if not serving.accepting:
            raise ApiError(503, "the server is shutting down")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return serving.models.show_available_models()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(client.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> dict:
        return await serving.tokenize(parse_body(TokenizeRequest, await read_json(raw, limit)), raw)

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> dict:
        return serving.detokenize(parse_body(DetokenizeRequest, await read_json(raw, limit)))

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await serving.create_completion(parse_body(CompletionRequest, await read_json(raw, limit)), raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await serving.create_chat_completion(parse_body(ChatCompletionRequest, await read_json(raw, limit)),
                                                    raw)

    @app.post("/v1/embeddings")
    async def embeddings(raw: Request) -> Response:
        return await pooling.create_embedding(parse_body(EmbeddingRequest, await read_json(raw, limit)), raw)

    @app.post("/pooling")
    async def pooled(raw: Request) -> Response:
        return await pooling.create_embedding(parse_body(EmbeddingRequest, await read_json(raw, limit)), raw,
                                              "pooling")

    @app.post("/score")
    @app.post("/v1/score")
    async def score(raw: Request) -> Response:
        return await pooling.create_score(parse_body(ScoreRequest, await read_json(raw, limit)), raw)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(raw: Request) -> Response:
        return await pooling.create_rerank(parse_body(RerankRequest, await read_json(raw, limit)), raw)

    if lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(raw: Request) -> Response:
            body = parse_body(LoadLoRAAdapterRequest, await read_json(raw, limit))
            return PlainTextResponse(await serving.models.load_lora_adapter(body))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(raw: Request) -> Response:
            body = parse_body(UnloadLoRAAdapterRequest, await read_json(raw, limit))
            return PlainTextResponse(serving.models.unload_lora_adapter(body))

    document_api(app, public_paths)
    return app


class DrainingServer(uvicorn.Server):
    """The first SIGTERM / SIGINT starts `drain` instead of stopping at once; a second one forces the exit:
    `abort` ends what is still in flight (each client gets its partial output, finish_reason "abort") and the
    server stops without waiting for the drain."""

    def __init__(self, config: uvicorn.Config, drain, abort) -> None:
        super().__init__(config)
        self.drain = drain
        self.abort = abort
        self.drain_started = False
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        # Unlike uvicorn's, records no signal to re-raise at exit: a drained shutdown exits with status 0.
        if self.drain_started:
            self.should_exit = self.force_exit = True
            return
        self.drain_started = True
        self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.drain(self)))

    async def shutdown(self, sockets=None) -> None:
        if self.force_exit:
            # The handlers end here, their responses complete: uvicorn would leave them running, and asyncio.run's
            # exit would cancel each one, which uvicorn logs as an "Exception in ASGI application".
            self.abort()
            handlers = set(self.server_state.tasks)
            if handlers:
                await asyncio.wait(handlers, timeout=_UVICORN_GRACE_SECONDS)
        await super().shutdown(sockets)


def _abort_in_flight(client: CoreClient, serving: OpenAIServing) -> None:
    """End every request in flight now (their blocks freed in the core); beam searches take no further step."""
    serving.aborting = True
    client.abort_all()


async def _drain(client: CoreClient, serving: OpenAIServing, server: DrainingServer, timeout: float) -> None:
    """Refuse new requests (503), let running ones finish for up to `timeout` seconds, abort the rest, exit."""
    serving.accepting = False

    def in_flight() -> int:
        return client.num_unfinished + serving.num_beam_searches

    logger.info("shutting down: refusing new requests, waiting up to %.0f s for %d in flight", timeout, in_flight())
    deadline = time.monotonic() + timeout
    while in_flight() and client.dead_reason is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if in_flight():
        logger.warning("aborting %d requests still in flight", in_flight())
        _abort_in_flight(client, serving)
    server.should_exit = True


async def _log_stats(metrics: ServerMetrics, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        line = metrics.log_line()
        if line is not None:
            logger.info(line)


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the engine starts: a taken port or a bad host fails at once, not after
    the model has loaded."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e}") from None


async def serve(config: EngineConfig, options: ServeOptions) -> None:
    """Start the engine core, then serve HTTP until a signal drains and stops the server."""
    sock = _listen(options.host, options.port)
    metrics = ServerMetrics(options.served_model_names[0], config.max_loras if config.enable_lora else None)
    client = CoreClient(config, metrics, options.max_output_tokens_per_request)
    stats_task = serving = None
    loop = asyncio.get_running_loop()
    # Until uvicorn takes over the signal, SIGTERM stops the start-up (the core is then stopped below), not the
    # process at once: that would leave the core loading the model with no one to tell it to exit.
    loop.add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    try:
        try:
            models = OpenAIServingModels(client, options.served_model_names, options.lora_modules)
            await client.start(models.lora_requests.values())
        except asyncio.CancelledError:
            logger.info("SIGTERM during start-up: the server stops")
            return
        finally:
            loop.remove_signal_handler(signal.SIGTERM)
        serving = OpenAIServing(client, models, options.log_prompts,
                                options.tool_call_parser if options.enable_auto_tool_choice else None,
                                options.trust_request_chat_template)
        app = build_app(client, serving, options, runtime_lora_updating(config.enable_lora))
        uvicorn_config = uvicorn.Config(app, host=options.host, port=options.port, access_log=options.access_log,
                                        log_level=options.uvicorn_log_level,
                                        timeout_graceful_shutdown=_UVICORN_GRACE_SECONDS, lifespan="off")
        server = DrainingServer(uvicorn_config, lambda s: _drain(client, serving, s, options.shutdown_timeout),
                                lambda: _abort_in_flight(client, serving))
        if options.log_stats_interval > 0:
            stats_task = asyncio.create_task(_log_stats(metrics, options.log_stats_interval))
        await server.serve(sockets=[sock])
    finally:
        sock.close()
        if stats_task is not None:
            stats_task.cancel()
        if serving is not None:
            serving.tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        await client.shutdown()
    logger.info("server stopped")


def run_server(config: EngineConfig, options: ServeOptions) -> None:
    asyncio.run(serve(config, options))
