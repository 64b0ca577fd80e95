"""`nanoinfer generate | chat | serve`: every EngineConfig field is a flag."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import types
import typing

from nanoinfer.config import EngineConfig

SAMPLING_FLAGS = {  # flag -> (SamplingParams field, type, default, help)
    "--max-tokens": ("max_tokens", int, 256, "most tokens to generate (unset: at most what the context leaves)"),
    "--temperature": ("temperature", float, 0.7, "0 = greedy"),
    "--top-p": ("top_p", float, 1.0, "nucleus sampling mass"),
    "--top-k": ("top_k", int, 0, "sample from the k most likely tokens (0 = off)"),
    "--min-p": ("min_p", float, 0.0, "drop tokens below min_p x the top probability"),
    "--repetition-penalty": ("repetition_penalty", float, 1.0, "penalise tokens already seen"),
    "--sampling-seed": ("seed", int, None, "seed of the request's sampling, for reproducible output "
                                           "(unset: the engine's random stream, seeded by --seed)"),
    "--stop": ("stop", str, None, "stop when this string is generated (repeatable)"),
    "--ignore-eos": ("ignore_eos", bool, False, "keep generating past the end-of-sequence token"),
}


def _field_type(f: dataclasses.Field) -> type:
    hint = typing.get_type_hints(EngineConfig)[f.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def json_flag(text: str, valid: typing.Callable[[object], bool], what: str) -> typing.Any:
    """A flag's JSON value, or an argparse error that says what is wrong with it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON ({e})") from None
    if not valid(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def json_object(text: str) -> dict:
    return json_flag(text, lambda v: isinstance(v, dict), "a JSON object ({...})")


def json_strings(text: str) -> list[str]:
    return json_flag(text, lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
                     'a JSON list of strings (["...", ...])')


class _TextRunner(argparse.Action):
    """--runner of `generate` and `chat`: they print text, so `pooling` (embeddings) is refused before any loading."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values == "pooling":
            raise argparse.ArgumentError(self, "pooling makes embeddings, which generate and chat do not print; use "
                                               "`nanoinfer serve MODEL --runner pooling` (/v1/embeddings) or LLM.embed")
        setattr(namespace, self.dest, values)


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (), text_only: bool = False) -> None:
    """One flag per EngineConfig field; `text_only`: the command prints generated text (--runner pooling refused)."""
    group = parser.add_argument_group("engine arguments")
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        flag, kind = "--" + f.name.replace("_", "-"), _field_type(f)
        flags = (flag, "-tp") if f.name == "tensor_parallel_size" else (flag,)  # vLLM's short form
        # A default of None means "unset": the help says what that does, where it matters.
        help_text = f.metadata["help"] if f.default is None else f"{f.metadata['help']} (default: {f.default})"
        text_runner = text_only and f.name == "runner"
        if text_runner:
            help_text += "; this command takes generate only (embeddings: serve --runner pooling, LLM.embed)"
        if kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:  # a dict is given as JSON
            group.add_argument(*flags, type=json_object if kind is dict else kind, default=f.default,
                               choices=f.metadata.get("choices"), help=help_text,
                               action=_TextRunner if text_runner else "store")


def engine_kwargs(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.name not in skip}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Unset flags are None: `sampling_params` tells them from given ones."""
    from nanoinfer.loader.resolve import GENERATION_FIELDS  # what generation_config.json may set

    group = parser.add_argument_group("sampling arguments")
    for flag, (name, kind, default, help_text) in SAMPLING_FLAGS.items():
        if kind is bool:
            group.add_argument(flag, action="store_true", default=None, help=help_text)
        elif flag == "--stop":
            group.add_argument(flag, action="append", help=help_text)
        else:
            if name in GENERATION_FIELDS.values():
                help_text += f" (default: the model's generation_config.json, else {default})"
            elif default is not None:
                help_text += f" (default: {default})"
            group.add_argument(flag, type=kind, default=None, help=help_text)


def sampling_params(args: argparse.Namespace, model_defaults: dict):
    """The flags given, then the model's recommendations (generation_config.json), then the CLI's defaults."""
    from nanoinfer.sampling_params import SamplingParams

    given = {name: getattr(args, flag[2:].replace("-", "_")) for flag, (name, *_) in SAMPLING_FLAGS.items()}
    defaults = {name: default for name, _, default, _ in SAMPLING_FLAGS.values()}
    return SamplingParams(**(defaults | model_defaults | {k: v for k, v in given.items() if v is not None}))


def _fit_to_context(llm, params, args: argparse.Namespace, prompt: list[int]):
    """The CLI's own default max_tokens, cut to what the context leaves after `prompt` (a model of a short context
    or a long chat). A count the user or the model's generation_config.json gave is kept: its error says why."""
    if args.max_tokens is not None or "max_tokens" in llm.llm_engine.default_sampling:
        return params
    room = llm.llm_engine.input_processor.check_length(len(prompt), None)  # (a prompt that fills the context: an error)
    return dataclasses.replace(params, max_tokens=min(params.max_tokens, room))


def _build_llm(args: argparse.Namespace):
    from nanoinfer import LLM

    kwargs = engine_kwargs(args)
    return LLM(**kwargs)


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _build_llm(args)
    params = sampling_params(args, llm.llm_engine.default_sampling)
    prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat \
        else llm.llm_engine.input_processor.tokenize(args.prompt)  # token ids: counted once, for `_fit_to_context`
    for text in llm.stream(prompt, _fit_to_context(llm, params, args, prompt)):
        print(text, end="", flush=True)
    print()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _build_llm(args)
    params = sampling_params(args, llm.llm_engine.default_sampling)
    messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    print("Chatting with the model; an empty line or Ctrl-D ends.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = []
        prompt = llm.apply_chat_template(messages)
        for text in llm.stream(prompt, _fit_to_context(llm, params, args, prompt)):
            print(text, end="", flush=True)
            reply.append(text)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoinfer", description="A small, fast LLM inference and serving engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streaming to the terminal")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    add_sampling_args(gen)
    add_engine_args(gen, text_only=True)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat through the model's chat template")
    chat.add_argument("--system", default=None, help="a system message")
    add_sampling_args(chat)
    add_engine_args(chat, text_only=True)
    chat.set_defaults(func=cmd_chat)

    from nanoinfer.server.cli import add_serve_parser  # light: the server's heavy imports happen on `serve`

    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError, RuntimeError) as e:  # OSError: an unreadable file, among others
        print(f"nanoinfer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
