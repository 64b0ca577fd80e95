"""`nanoinfer serve [MODEL] [--host --port --api-key ...] [engine args]`."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from nanoinfer.cli import add_engine_args, engine_kwargs, json_flag, json_strings
from nanoinfer.config import EngineConfig
from nanoinfer.server.tool_calls import TOOL_CALL_PARSERS


@dataclass(frozen=True)
class LoRAModulePath:
    """A LoRA adapter served from the start (vLLM's --lora-modules): requests name it as their model."""

    name: str
    path: str
    base_model_name: str | None = None  # the served name /v1/models gives as its parent (default: the first)


def _is_lora_module(value: object) -> bool:
    return isinstance(value, dict) and value.keys() <= {"name", "path", "base_model_name"} and \
        all(isinstance(value.get(key), str) and value[key] for key in ("name", "path")) and \
        isinstance(value.get("base_model_name"), (str, type(None)))


def lora_module(text: str) -> LoRAModulePath:
    """One --lora-modules value, in either of vLLM's forms: NAME=PATH, or a JSON object
    {"name": ..., "path": ..., "base_model_name": ...}."""
    if text.lstrip().startswith("{"):
        return LoRAModulePath(**json_flag(text, _is_lora_module, 'a JSON object {"name": str, "path": str, '
                                                                 '"base_model_name": str (optional)}'))
    name, equals, path = text.partition("=")
    if not (name and equals and path):
        raise argparse.ArgumentTypeError(f'{text!r} is neither NAME=PATH nor a JSON object '
                                         f'{{"name": ..., "path": ...}}')
    return LoRAModulePath(name, path)


def add_serve_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (streaming, metrics)")
    parser.add_argument("model", nargs="?", default=None,
                        help="model folder, .gguf file, config.json (dummy weights) or Hugging Face Hub name "
                             "(org/name); default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument("--api-key", default=os.environ.get("NANOINFER_API_KEY") or None,
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health and /ping "
                             "(default: $NANOINFER_API_KEY if set and not empty, else none)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="name(s) clients use for the model; the first appears in responses "
                             "(default: the model argument)")
    parser.add_argument("--max-request-body-bytes", type=int, default=4 << 20,
                        help="larger request bodies get 413 (default: 4 MiB)")
    parser.add_argument("--max-output-tokens-per-request", type=int, default=1 << 20,
                        help="largest max_tokens x n x prompts one request may ask for; 400 beyond (default: 1Mi)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds in-flight requests may run before they are aborted (default: 30)")
    parser.add_argument("--log-stats-interval", type=float, default=5.0,
                        help="seconds between throughput / queue / KV-cache log lines; 0 = off (default: 5)")
    parser.add_argument("--disable-log-stats", action="store_true", help="vLLM's: --log-stats-interval 0")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["debug", "info", "warning", "error", "critical", "trace"],
                        help="the HTTP server's (uvicorn's) log level (default: info)")
    parser.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                        help="log every HTTP request (default: on)")
    parser.add_argument("--metrics-without-auth", action="store_true",
                        help="serve /metrics without the API key, for a scraper (default: the key is needed)")
    parser.add_argument("--log-prompts", action="store_true",
                        help="log each request's prompts and sampling parameters (default: prompts are never logged)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='serve tool_choice "auto" (the default with tools): the model decides whether to call, '
                             'and --tool-call-parser reads its calls out of the text (default: off; "required" and '
                             'named functions work without it)')
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS), default=None,
                        help="the model's tool call format: hermes (<tool_call>{...}</tool_call>: Qwen2.5, Qwen3, "
                             "Hermes), llama3_json (<|python_tag|>{...}; {...}: Llama 3.1-3.3 with a JSON tool "
                             "template), mistral ([TOOL_CALLS][{...}] or [TOOL_CALLS]name[ARGS]{...}: Mistral models), "
                             "pythonic ([f(a=1), g()]: Llama 3.2 and Llama 4 with a pythonic template)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="render a request's own chat_template (Jinja, in a sandbox, yet a template may loop for "
                             "long: trust the clients; default: such a request is refused)")
    parser.add_argument("--lora-modules", nargs="+", type=lora_module, default=(), metavar="NAME=PATH",
                        help='LoRA adapters (PEFT folders) requests may name as their model, each NAME=PATH or a JSON '
                             'object {"name": ..., "path": ..., "base_model_name": ...}; needs --enable-lora')
    for name, what in (("origins", "origins (e.g. https://example.com) whose browser pages may call the server"),
                       ("methods", "HTTP methods those pages may use"), ("headers", "request headers they may send")):
        parser.add_argument(f"--allowed-{name}", type=json_strings, default=["*"],
                            help=f"CORS: the {what}, a JSON list (default: [\"*\"], all, as vLLM's)")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="CORS: let those pages send cookies and HTTP authentication (default: off)")
    add_engine_args(parser, skip=("model",))
    parser.set_defaults(func=cmd_serve)


def serve_options(args: argparse.Namespace):
    """The server's own options (ServeOptions) from its flags."""
    from nanoinfer.loader.default_model import DEFAULT_MODEL_NAME
    from nanoinfer.server.api_server import ServeOptions

    return ServeOptions(
        host=args.host, port=args.port, api_key=args.api_key,
        served_model_names=tuple(args.served_model_name or [args.model or DEFAULT_MODEL_NAME]),
        max_request_body_bytes=args.max_request_body_bytes,
        max_output_tokens_per_request=args.max_output_tokens_per_request,
        shutdown_timeout=args.shutdown_timeout, uvicorn_log_level=args.uvicorn_log_level,
        log_stats_interval=0 if args.disable_log_stats else args.log_stats_interval,
        access_log=args.access_log, metrics_without_auth=args.metrics_without_auth, log_prompts=args.log_prompts,
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        trust_request_chat_template=args.trust_request_chat_template, allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods), allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials, lora_modules=tuple(args.lora_modules))


def cmd_serve(args: argparse.Namespace) -> int:
    from nanoinfer.server.api_server import run_server

    options = serve_options(args)
    config = EngineConfig.from_kwargs(model=args.model, **engine_kwargs(args, skip=("model",)))
    run_server(config, options)
    return 0
