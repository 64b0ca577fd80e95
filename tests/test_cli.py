"""The command line: `nanoinfer generate` streams text, `chat` answers on stdin,
`--help` lists every engine argument, bad input exits with a clear message."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys

from nanoinfer.config import EngineConfig

CLI = [sys.executable, "-m", "nanoinfer.cli"]
SMALL = ["--kv-cache-memory-bytes", str(32 << 20), "--max-model-len", "512"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + args, input=stdin, capture_output=True, text=True, timeout=300, env=ENV)


def test_help_lists_every_engine_argument() -> None:
    out = run(["generate", "--help"]).stdout
    for f in dataclasses.fields(EngineConfig):
        assert "--" + f.name.replace("_", "-") in out
    assert "(default: None)" not in " ".join(out.split())  # unset is said in words, once


def test_json_flags_say_what_is_wrong() -> None:
    """A flag that takes JSON names the problem (it was argparse's "invalid loads value"), before any loading."""
    for command in (["generate", "x"], ["serve", "--port", "0"]):
        proc = run([*command, "--speculative-config", "notjson"])
        assert proc.returncode == 2 and "argument --speculative-config: 'notjson' is not valid JSON" in proc.stderr
        assert "loads" not in proc.stderr
        proc = run([*command, "--pooler-config", "[1]"])
        assert proc.returncode == 2 and "argument --pooler-config: '[1]' is not a JSON object" in proc.stderr
    proc = run(["serve", "--allowed-origins", '"*"'])
    assert proc.returncode == 2 and "argument --allowed-origins: '\"*\"' is not a JSON list of strings" in proc.stderr


def test_generate_and_chat_refuse_the_pooling_runner(tmp_path) -> None:
    """They print text: --runner pooling is an argparse error before the model loads (it loaded the model, then
    failed on "PoolingParams, not SamplingParams"). The missing model shows nothing was loaded."""
    missing = str(tmp_path / "missing")
    for command in (["generate", "x"], ["chat"]):
        proc = run([*command, "--runner", "pooling", "--model", missing], stdin="")
        assert proc.returncode == 2 and "argument --runner: pooling makes embeddings" in proc.stderr, proc.stderr
        assert "does not exist" not in proc.stderr and "Traceback" not in proc.stderr


def test_generate_streams_greedy_text(smollm2_path) -> None:
    from nanoinfer import LLM, SamplingParams

    proc = run(["generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0", *SMALL])
    assert proc.returncode == 0, proc.stderr
    expected = LLM(kv_cache_memory_bytes=32 << 20, max_model_len=512).generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    assert proc.stdout.strip() == expected.strip()


def test_the_default_max_tokens_fits_a_short_context(smollm2_path) -> None:
    """The CLI's default of 256 tokens is cut to what the context leaves (it was an error with max_model_len 64)."""
    from nanoinfer import LLM, SamplingParams

    short = ["--kv-cache-memory-bytes", str(32 << 20), "--max-model-len", "64"]
    proc = run(["generate", "The capital of France is", "--temperature", "0", "--ignore-eos", *short])
    assert proc.returncode == 0, proc.stderr
    rest = LLM(kv_cache_memory_bytes=32 << 20, max_model_len=64).generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert proc.stdout.strip() == rest[0].outputs[0].text.strip() and len(rest[0].outputs[0].token_ids) > 50


def test_chat_reads_stdin(smollm2_path) -> None:
    proc = run(["chat", "--max-tokens", "6", "--temperature", "0", *SMALL], stdin="Hi!\n\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


def test_bad_input_exits_with_message(tmp_path) -> None:
    proc = run(["generate", "x", "--model", str(tmp_path / "missing")])
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = run(["generate", "x", "--max-tokens", "0", *SMALL])
    assert proc.returncode == 2 and "max_tokens" in proc.stderr
    proc = run(["generate", "x", "--no-such-flag"])
    assert proc.returncode == 2 and "unrecognized arguments" in proc.stderr
    # A user mistake in the model's files is one line, not a traceback (and serve refuses a taken port before
    # it loads the model).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run(["serve", str(tmp_path / "missing"), "--port", "0"])
        assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
        proc = run(["serve", "--port", str(port), *SMALL])
        assert proc.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in proc.stderr
        assert "Traceback" not in proc.stderr and "KV cache" not in proc.stderr  # refused before the engine started


def test_serve_reports_a_broken_checkpoint_in_one_line(tmp_path, tiny_models) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "missing_weight"
    shutil.copytree(tiny_models["llama"], folder)
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.endswith("layers.0.self_attn.q_proj.weight")},
              folder / "model.safetensors")
    proc = run(["serve", str(folder), "--port", "0", *SMALL])
    assert proc.returncode == 2 and "missing weights" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_serve_options_refuse_nonsense() -> None:
    import pytest

    from nanoinfer.server.api_server import ServeOptions

    for bad, words in (({"shutdown_timeout": float("nan")}, "shutdown_timeout"),
                       ({"log_stats_interval": float("inf")}, "log_stats_interval"),
                       ({"log_stats_interval": -1.0}, "log_stats_interval"),
                       ({"api_key": ""}, "api_key is empty"),
                       ({"served_model_names": ("",)}, "non-empty"),
                       ({"served_model_names": ("a", "a")}, "distinct"),
                       ({"port": 70000}, "port"),
                       ({"enable_auto_tool_choice": True}, "needs a tool_call_parser"),
                       ({"tool_call_parser": "nope"}, "tool_call_parser must be one of")):
        with pytest.raises(ValueError, match=words):
            ServeOptions(**bad)
    ServeOptions(shutdown_timeout=float("inf"), served_model_names=("a", "b"))  # wait forever: allowed
    # On the command line the same mistakes are one line, before any model is loaded.
    proc = run(["serve", "--shutdown-timeout", "nan", "--port", "0"])
    assert proc.returncode == 2 and "shutdown_timeout" in proc.stderr and "Traceback" not in proc.stderr
    proc = run(["serve", "--served-model-name", "", "--port", "0"])
    assert proc.returncode == 2 and "served_model_names" in proc.stderr
    proc = run(["serve", "--chat-template", "{% for m in messages %}{{ m.content }", "--port", "0"])
    assert proc.returncode == 2 and "Jinja syntax error" in proc.stderr and "Traceback" not in proc.stderr


def test_vllm_serve_flags() -> None:
    """vLLM's -tp, --disable-log-stats, --uvicorn-log-level, --trust-remote-code and CORS flags parse into the
    engine's and the server's settings."""
    from nanoinfer.cli import build_parser, engine_kwargs
    from nanoinfer.server.cli import serve_options

    args = build_parser().parse_args(["serve", "org/name", "-tp", "2", "--disable-log-stats", "--uvicorn-log-level",
                                      "warning", "--trust-remote-code", "--allowed-origins", '["https://a.example"]'])
    kwargs, options = engine_kwargs(args), serve_options(args)
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["trust_remote_code"] is True
    assert options.log_stats_interval == 0 and options.uvicorn_log_level == "warning"
    assert options.allowed_origins == ("https://a.example",) and options.allowed_methods == ("*",)
    assert options.served_model_names == ("org/name",)
    default = serve_options(build_parser().parse_args(["serve"]))
    assert default.log_stats_interval == 5.0 and default.uvicorn_log_level == "info"
