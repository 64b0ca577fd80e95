"""Server life cycle: the bounded waiting queue (503 + Retry-After), draining
on SIGTERM, and failing fast when the engine-core process dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from transformers import AutoTokenizer

from conftest import make_tiny_model
from test_server import launch_server, metric_values, tiny_model_with_smollm2_vocab, wait_for

LONG = {"prompt": "Tell me a long story", "max_tokens": 480, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return tiny_model_with_smollm2_vocab(tmp_path_factory)


def stream_events(url: str, body: dict, events: list, first_event: threading.Event,
                  arrivals: list | None = None) -> threading.Thread:
    """Stream a completion in a thread, appending each decoded event ("[DONE]" kept as is) and, to `arrivals`,
    the time it came."""

    def run() -> None:
        try:
            with httpx.Client(timeout=120) as http:
                with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            data = line[len("data: "):]
                            events.append(data if data == "[DONE]" else json.loads(data))
                            if arrivals is not None:
                                arrivals.append(time.monotonic())
                            first_event.set()
        except httpx.RemoteProtocolError:  # the server stopped mid-stream; the events so far say what happened
            pass
        first_event.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_queue_bound_then_sigterm_drain(model_path, smollm2_path, tmp_path):
    server = launch_server(str(tmp_path / "server.log"), model_path, "--tokenizer", smollm2_path,
                           "--max-num-seqs", "1", "--max-num-waiting", "1", "--shutdown-timeout", "3")
    core = psutil.Process(server.core_pid())
    try:
        running, waiting = [], []
        started = threading.Event()
        running_thread = stream_events(server.url, LONG, running, started)
        assert started.wait(60) and isinstance(running[0], dict)  # generating: scheduled
        queued = threading.Event()
        waiting_thread = stream_events(server.url, LONG, waiting, queued)
        # max_num_seqs=1: the second request waits, and the queue holds only one.
        wait_for(lambda: metric_values(server.url)[("nanoinfer:num_requests_waiting", ())] == 1, what="a waiting request")
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 503 and response.headers["Retry-After"] == "1"
        assert "waiting queue is full" in response.json()["error"]["message"]
        never = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "n": 2})  # could never fit
        assert never.status_code == 400 and "places in the waiting queue" in never.json()["error"]["message"]
        beams = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "n": 2, "use_beam_search": True})
        assert beams.status_code == 400 and "places in the waiting queue" in beams.json()["error"]["message"]

        server.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 503, what="draining")
        refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"})
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert server.proc.wait(30) == 0, server.log()
        assert time.monotonic() - sent < 3 + 10
        running_thread.join(10)
        waiting_thread.join(10)
        for events in (running, waiting):  # each stream ended properly: finished, or aborted at the timeout
            assert events[-1] == "[DONE]"
            finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
            assert finish[-1] in ("length", "abort") and all(f is None for f in finish[:-1])
        wait_for(lambda: not core.is_running() or core.status() == psutil.STATUS_ZOMBIE, what="the core to exit")
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def _exited(process: psutil.Process) -> bool:
    return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_server_stopped_while_starting_leaves_no_core(model_path, smollm2_path, tmp_path, sig):
    """A supervisor may stop a server before its model has loaded. SIGTERM then stops the start-up and the core
    with it (it used to kill the API process at once, leaving the core running for ever); after SIGKILL, which
    allows no clean-up, the core exits once it finds the API process gone, by the pid it was given (the parent
    it saw at its own start could already be another process)."""
    server = launch_server(str(tmp_path / "server.log"), model_path, "--tokenizer", smollm2_path, wait=False)
    try:
        wait_for(lambda: any("spawn_main" in part for c in psutil.Process(server.proc.pid).children()
                             for part in c.cmdline()), timeout=60, what="the core process")
        core = psutil.Process(server.core_pid())
        server.proc.send_signal(sig)
        assert server.proc.wait(60) == (0 if sig == signal.SIGTERM else -signal.SIGKILL), server.log()
        wait_for(lambda: _exited(core), timeout=90, what="the core to exit")
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_a_beam_search_in_flight_finishes_during_the_drain(model_path, smollm2_path, tmp_path):
    """A beam search runs step after step of one-token requests: the drain lets it finish, as any request in flight
    (its steps used to be refused as new requests: a 503)."""
    server = launch_server(str(tmp_path / "server.log"), model_path, "--tokenizer", smollm2_path,
                           "--shutdown-timeout", "60")
    try:
        body = {"prompt": "hi", "max_tokens": 150, "use_beam_search": True, "n": 2, "ignore_eos": True}
        result = {}
        thread = threading.Thread(target=lambda: result.update(
            response=httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)), daemon=True)
        thread.start()
        # Steps done (a beam step's request has finished by the time its stats arrive: running reads 0 between them).
        wait_for(lambda: metric_values(server.url).get(("nanoinfer:generation_tokens_total", ()), 0) >= 2, timeout=60,
                 what="a beam step done")
        server.proc.send_signal(signal.SIGTERM)
        thread.join(120)
        response = result["response"]
        assert response.status_code == 200, response.text
        assert [len(c["text"]) > 0 for c in response.json()["choices"]] == [True, True]
        assert response.json()["usage"]["completion_tokens"] == 2 * 150
        assert server.proc.wait(60) == 0, server.log()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_a_forced_exit_ends_open_streams_as_aborted(model_path, smollm2_path, tmp_path):
    """A second SIGTERM ends the drain at once: each open stream gets its last chunk (finish_reason "abort") and
    [DONE], then the server exits; the streams' aborts send the closed core nothing (each used to log a
    ZMQError), and no handler is left for asyncio's exit to cancel (uvicorn logged each one as an exception)."""
    server = launch_server(str(tmp_path / "server.log"), model_path, "--tokenizer", smollm2_path,
                           "--shutdown-timeout", "60")
    try:
        streams = [([], threading.Event()) for _ in range(3)]
        threads = [stream_events(server.url, LONG, events, started)
                   for events, started in streams]
        assert all(started.wait(60) for _, started in streams)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.log()
        for thread in threads:
            thread.join(10)
        for events, _ in streams:
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "abort", events[-3:]
        log = server.log()
        assert "internal error" not in log and "ZMQError" not in log and "Traceback" not in log, log
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_core_death_fails_fast(model_path, smollm2_path, tmp_path):
    server = launch_server(str(tmp_path / "server.log"), model_path, "--tokenizer", smollm2_path)
    try:
        events: list = []
        started = threading.Event()
        thread = stream_events(server.url, LONG, events, started)
        assert started.wait(60)
        os.kill(server.core_pid(), signal.SIGKILL)
        thread.join(30)
        assert events[-1] == "[DONE]" and "engine core" in events[-2]["error"]["message"]  # the stream ends, not hangs
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "engine core process died" in health.json()["error"]["message"]
        start = time.monotonic()
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert response.status_code == 503 and time.monotonic() - start < 2
        assert response.json()["error"]["code"] == 503
        assert server.stop(30) == 0, server.log()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_a_long_prompt_is_tokenized_off_the_event_loop(smollm2_path, tmp_path):
    """Text is tokenized in a worker thread (the tokenizer releases the GIL): a prompt of megabytes, which takes
    the tokenizer a second or more, does not stall the streams in flight."""
    model = make_tiny_model(str(tmp_path / "long_context"), "llama", vocab_size=49152, max_position_embeddings=1 << 16)
    server = launch_server(str(tmp_path / "server.log"), model, "--tokenizer", smollm2_path,
                           "--max-request-body-bytes", str(8 << 20), "--shutdown-timeout", "1")
    try:
        events, arrivals, started = [], [], threading.Event()
        thread = stream_events(server.url, {**LONG, "max_tokens": 20_000}, events, started, arrivals)
        assert started.wait(60)
        start = time.monotonic()
        big = httpx.post(f"{server.url}/v1/completions", timeout=120,
                         json={"prompt": "Tell me a long story about the sea. " * 60_000, "max_tokens": 1})
        end = time.monotonic()
        # Tokenized in full, then refused: more tokens than the 16 MB KV cache holds.
        assert big.status_code == 400 and "KV cache" in big.json()["error"]["message"], big.text
        assert end - start > 0.4, "the prompt tokenized too fast to show a stall"
        during = [t for t in arrivals if start <= t <= end]
        gaps = [b - a for a, b in zip([start, *during], [*during, end])]
        assert len(during) >= 5 and max(gaps) < 0.3 * (end - start), (end - start, len(during), max(gaps))
        # The other large-body paths through the thread: /tokenize and a chat template.
        text = "The sea was calm that night. " * 1000  # 29 KB: past the 16 KB tokenized on the event loop
        counted = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
        assert counted["tokens"] == AutoTokenizer.from_pretrained(smollm2_path).encode(text, add_special_tokens=False)
        chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": text}], "max_tokens": 2})
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] > counted["count"], chat.text
        assert server.stop(30) == 0, server.log()
        thread.join(30)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_the_core_process_freezes_what_its_engine_built(tmp_path):
    """The engine-core process holds one engine until it exits: after start-up its KV block metadata (an object
    per block) is out of the collector's view, so full collections do not walk it during steps."""
    model = make_tiny_model(str(tmp_path / "tiny"), "llama")
    script = f"""
import gc
import os
from nanoinfer.config import EngineConfig
from nanoinfer.loader.resolve import resolve_model
from nanoinfer.server.core_process import EngineCoreProc

config = EngineConfig.from_kwargs(model={model!r}, num_kv_blocks=4096)
proc = EngineCoreProc("ipc://{tmp_path}/in", "ipc://{tmp_path}/out", os.getppid())
proc.start(config, resolve_model(config))
blocks = proc.core.scheduler.kv_cache_manager.pool.blocks
tracked = {{id(o) for o in gc.get_objects()}}
print("collectable blocks:", sum(id(b) in tracked for b in blocks), "of", len(blocks))
proc.close()
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "collectable blocks: 0 of 4096" in result.stdout, result.stdout
