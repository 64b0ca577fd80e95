"""Fault injection: one request's sampling or detokenization raising fails that
request only (offline and over HTTP); the engine-core process killed mid-run
fails in-flight requests fast with 503; the API process killed takes the core
with it; with NANOINFER_DEBUG_CHECKS=1 the server's core catches a leaked KV
block at once; a tensor-parallel worker killed mid-stream is a clear error, not
a hang (at the engine level: tests/test_tensor_parallel.py).

Faults are injected by monkeypatching (in-process) or, for a server, by a
sitecustomize.py on PYTHONPATH that applies the same patches in both of its
processes: the production code has no fault hooks."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import time

import httpx
import psutil
import pytest

from logprobs_close import approx_logprobs
from test_server import launch_server, metric_values, tiny_model_with_smollm2_vocab, wait_for
from nanoinfer import LLM, SamplingParams

POISON_TEMPERATURE = 1.25  # sampling a row at this temperature raises
POISON_STOP = "POISON"  # detokenizing a request with this stop string raises
LEAK_TEMPERATURE = 1.75  # a request at this temperature leaks its KV blocks when freed


def install_faults(setattr=setattr, poison_temperature=POISON_TEMPERATURE, poison_stop=POISON_STOP,
                   leak_temperature=LEAK_TEMPERATURE) -> None:
    """Patch the engine so that marked requests fail. Self-contained: its source
    becomes a server's sitecustomize.py."""
    from nanoinfer.engine.detokenizer import IncrementalDetokenizer
    from nanoinfer.kv_cache.manager import KVCacheManager
    from nanoinfer.sample.sampler import Sampler

    forward, update, free = Sampler.forward, IncrementalDetokenizer.update, KVCacheManager.free

    def poisoned_forward(self, logits, metadata):
        if (metadata.temperature == poison_temperature).any():
            raise RuntimeError("injected sampling fault")
        return forward(self, logits, metadata)

    def poisoned_update(self, new_token_ids, stop_terminated=False):
        if poison_stop in self.stop:
            raise RuntimeError("injected detokenizer fault")
        return update(self, new_token_ids, stop_terminated)

    def leaky_free(self, request, uncache_computed=False):
        if request.sampling_params.temperature == leak_temperature:
            self.req_to_blocks.pop(request.request_id, None)  # forgotten, never returned to the pool
            return
        free(self, request, uncache_computed)

    setattr(Sampler, "forward", poisoned_forward)
    setattr(IncrementalDetokenizer, "update", poisoned_update)
    setattr(KVCacheManager, "free", leaky_free)


def launch_faulty_server(tmp_path, monkeypatch, model_path: str, *args: str):
    site = tmp_path / "site"
    site.mkdir()
    constants = f"POISON_TEMPERATURE, POISON_STOP, LEAK_TEMPERATURE = {POISON_TEMPERATURE}, {POISON_STOP!r}, {LEAK_TEMPERATURE}\n"
    (site / "sitecustomize.py").write_text(constants + inspect.getsource(install_faults) + "\n\ninstall_faults()\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("NANOINFER_DEBUG_CHECKS", "1")
    return launch_server(str(tmp_path / "server.log"), model_path, *args)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return tiny_model_with_smollm2_vocab(tmp_path_factory)


@pytest.fixture(scope="module")
def llm(model_path, smollm2_path) -> LLM:
    return LLM(model_path, tokenizer=smollm2_path, num_kv_blocks=256)


PROMPTS = ["The weather today", "Once upon a time", "1, 2, 3,", "Hello"]


# ----- in-process: one request fails, the batch goes on -----


def test_sampling_error_fails_only_that_request(llm, monkeypatch):
    params = [greedy(12), SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True),
              greedy(12, logprobs=2), greedy(12)]
    reference = llm.generate(PROMPTS, params, use_tqdm=False)
    install_faults(monkeypatch.setattr)
    poisoned = SamplingParams(temperature=POISON_TEMPERATURE, max_tokens=12)
    outputs = llm.generate(PROMPTS + PROMPTS[:1], params + [poisoned], use_tqdm=False)
    for out, ref in zip(outputs, reference):  # seeded, greedy and logprob rows are unchanged
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].logprobs == approx_logprobs(ref.outputs[0].logprobs)  # another batch
    failed = outputs[-1].outputs[0]
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert llm.llm_engine.core.scheduler.kv_cache_manager.usage == 0 and not llm.llm_engine.has_unfinished_requests()
    # ... and in another order, with logprobs on another row.
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1]]
    outputs = llm.generate(prompts, [greedy(12, logprobs=3), poisoned, greedy(5), params[1]], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "error", "length", "length"]
    assert outputs[3].outputs[0].token_ids == reference[1].outputs[0].token_ids
    assert len(outputs[0].outputs[0].logprobs) == 12 and all(len(lp) >= 3 for lp in outputs[0].outputs[0].logprobs)


def test_detokenizer_error_fails_only_that_request(llm, monkeypatch):
    reference = llm.generate(PROMPTS, greedy(10), use_tqdm=False)
    install_faults(monkeypatch.setattr)
    params = [greedy(10), greedy(10, stop=[POISON_STOP]), greedy(10), SamplingParams(n=2, max_tokens=10, stop=POISON_STOP)]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for i in (0, 2):
        assert outputs[i].outputs[0].text == reference[i].outputs[0].text
    assert outputs[1].outputs[0].finish_reason == "error"
    assert [c.finish_reason for c in outputs[3].outputs] == ["error", "error"]
    assert llm.llm_engine.core.scheduler.kv_cache_manager.usage == 0 and not llm.llm_engine.has_unfinished_requests()


# ----- over HTTP -----


async def _post(http: httpx.AsyncClient, url: str, body: dict) -> tuple[int, list]:
    """Status and, for a stream, its decoded events (else the JSON body as the one event)."""
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if not body.get("stream"):
            return response.status_code, [json.loads(await response.aread())]
        events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
        return response.status_code, [e if e == "[DONE]" else json.loads(e) for e in events]


def _text(result: tuple[int, list], stream: bool) -> str:
    status, events = result
    assert status == 200, events
    if not stream:
        return events[0]["choices"][0]["text"]
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
    return "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])


def test_server_isolates_failing_requests_then_fails_fast_when_its_core_dies(model_path, smollm2_path, llm,
                                                                              tmp_path, monkeypatch):
    server = launch_faulty_server(tmp_path, monkeypatch, model_path, "--tokenizer", smollm2_path)
    try:
        refs = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy(16), use_tqdm=False)]
        good = [{"prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": i % 2 == 1}
                for i, p in enumerate(PROMPTS)]
        bad = [{"prompt": "x", "max_tokens": 16, "temperature": POISON_TEMPERATURE, "stream": stream}
               for stream in (False, True)]
        bad += [{"prompt": "y", "max_tokens": 16, "stop": POISON_STOP, "stream": stream} for stream in (False, True)]

        async def run() -> list:
            async with httpx.AsyncClient(timeout=60) as http:
                return await asyncio.gather(*(_post(http, server.url, body) for body in good * 3 + bad))

        results = asyncio.run(run())
        assert [_text(r, body["stream"]) for r, body in zip(results, good * 3)] == refs * 3
        for (status, events), body in zip(results[-4:], bad):
            error = events[-2]["error"] if body["stream"] else events[0]["error"]
            assert status == (200 if body["stream"] else 500) and error["code"] == 500
            assert "injected" not in error["message"]  # internals stay in the log
            if body["stream"]:
                assert events[-1] == "[DONE]"
        wait_for(lambda: metric_values(server.url)[("nanoinfer:kv_cache_blocks_in_use", ())] == 0, what="idle")
        values = metric_values(server.url)
        assert values[("nanoinfer:request_success_total", (("finished_reason", "error"),))] == 4
        assert httpx.get(f"{server.url}/health").status_code == 200
        log = server.log()
        assert "injected sampling fault" in log and "injected detokenizer fault" in log

        # The core killed with requests in flight: every one fails fast (503), and so do new ones.
        async def in_flight() -> tuple[list, float]:
            async with httpx.AsyncClient(timeout=60) as http:
                long = {"prompt": "Tell me a story", "max_tokens": 400, "ignore_eos": True}
                tasks = [asyncio.create_task(_post(http, server.url, long | {"stream": i % 2 == 0})) for i in range(8)]
                deadline = time.monotonic() + 30
                while metric_values(server.url)[("nanoinfer:num_requests_running", ())] < 8:
                    assert time.monotonic() < deadline, "the 8 requests never ran together"
                    await asyncio.sleep(0.1)
                os.kill(server.core_pid(), signal.SIGKILL)
                killed = time.monotonic()
                results = await asyncio.gather(*tasks)
                return results, time.monotonic() - killed

        results, seconds = asyncio.run(in_flight())
        assert seconds < 5
        for i, (status, events) in enumerate(results):
            error = events[-2]["error"] if i % 2 == 0 else events[0]["error"]
            assert (status, error["code"]) == ((200, 503) if i % 2 == 0 else (503, 503))
            assert "engine core process died" in error["message"]
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "exit code -9" in health.json()["error"]["message"]
        start = time.monotonic()
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}).status_code == 503
        assert time.monotonic() - start < 1
        assert server.stop(30) == 0, server.log()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_debug_checks_in_the_server_core_catch_a_leaked_block(model_path, smollm2_path, tmp_path, monkeypatch):
    """NANOINFER_DEBUG_CHECKS=1 reaches the spawned core: a request whose blocks are not
    given back kills the core with the invariant it broke, instead of leaking quietly."""
    server = launch_faulty_server(tmp_path, monkeypatch, model_path, "--tokenizer", smollm2_path)
    try:
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi there", "max_tokens": 4}, timeout=60)
        assert ok.status_code == 200
        leaky = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"prompt": "hi there", "max_tokens": 4, "temperature": LEAK_TEMPERATURE})
        assert leaky.status_code in (200, 503)  # its answer may or may not beat the core's death
        wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 503, what="the core to fail its check")
        reason = httpx.get(f"{server.url}/health").json()["error"]["message"]
        assert "exit code 1" in reason and "AssertionError" in reason and "holders" in reason
        assert server.stop(30) == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_killed_api_process_takes_the_core_with_it(model_path, smollm2_path, tmp_path):
    server = launch_server(str(tmp_path / "server.log"), model_path, "--tokenizer", smollm2_path)
    core = psutil.Process(server.core_pid())
    try:
        body = {"prompt": "Tell me a story", "max_tokens": 400, "ignore_eos": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/v1/completions",
                                                           json=body | {"stream": True}) as response:
            next(response.iter_lines())  # generating
            server.proc.kill()
        server.proc.wait(10)
        start = time.monotonic()
        core.wait(10)  # raises psutil.TimeoutExpired if the core outlives its parent
        assert time.monotonic() - start < 5
    finally:
        if core.is_running():
            core.kill()


def test_killed_tensor_parallel_worker_fails_the_server_clearly(model_path, smollm2_path, tmp_path):
    """The engine-level test is tests/test_tensor_parallel.py; here through the server: no hang, a clear reason."""
    server = launch_server(str(tmp_path / "server.log"), model_path, "--tokenizer", smollm2_path,
                           "--tensor-parallel-size", "2", "--device", "cpu")
    try:
        core = psutil.Process(server.core_pid())
        worker = next(c for c in core.children() if any("spawn_main" in part for part in c.cmdline()))
        body = {"prompt": "Tell me a story", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(lines)  # generating
            worker.kill()
            start = time.monotonic()
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert time.monotonic() - start < 30 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and f"tensor-parallel worker rank 1 (pid {worker.pid})" in error["message"]
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "killed by SIGKILL" in health.json()["error"]["message"]
        assert server.stop(30) == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
