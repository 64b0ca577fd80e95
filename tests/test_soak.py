"""Soak, CI-sized: a live server (tiny random Llama, SmolLM2 tokenizer, a KV
cache of 40 blocks so requests get preempted) takes a few hundred requests
from 24 concurrent clients, the workload of bench/soak.py: random prompts,
lengths and sampling parameters, some invalid, some streams cut mid-way, some
non-streaming requests given up on. Every answer must be right, nothing may
leak, and the processes must not grow."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import httpx
import pytest

from test_server import launch_server, tiny_model_with_smollm2_vocab

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from soak import MODEL_NAME, check, make_jobs, references, rss_bytes, run_jobs, server_pids, summarize, wait_idle  # noqa: E402

from nanoinfer import LLM  # noqa: E402

NUM_KV_BLOCKS = 40  # 640 tokens: far less than 24 clients ask for at once
MAX_BODY, MAX_OUTPUT_TOKENS = 100_000, 2048
CONCURRENCY = 24
WARMUP_REQUESTS, SOAK_REQUESTS = 60, 200
# Server + core RSS may grow this much between the end of the warm-up and the end of the soak
# (allocator noise, caches that fill once); a per-request leak of a few KiB over 200 requests
# of ~30 tokens would not fit, one of the prompt tensors or token lists would.
MAX_RSS_GROWTH = 48 << 20


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return tiny_model_with_smollm2_vocab(tmp_path_factory)


def test_soak(model_path, smollm2_path, tmp_path):
    server = launch_server(str(tmp_path / "server.log"), model_path, "--tokenizer", smollm2_path,
                           "--served-model-name", MODEL_NAME, "--num-kv-blocks", str(NUM_KV_BLOCKS),
                           "--max-request-body-bytes", str(MAX_BODY),
                           "--max-output-tokens-per-request", str(MAX_OUTPUT_TOKENS), "--log-stats-interval", "0")
    try:
        pids = server_pids(server.proc.pid)
        assert len(pids) == 2
        jobs = make_jobs(WARMUP_REQUESTS + SOAK_REQUESTS, 1234, MAX_BODY, MAX_OUTPUT_TOKENS)
        before = wait_idle(server.url, {})
        start = time.monotonic()
        outcomes = asyncio.run(run_jobs(server.url, {}, jobs[:WARMUP_REQUESTS], CONCURRENCY))
        wait_idle(server.url, {})
        rss_warm = rss_bytes(pids)
        outcomes += asyncio.run(run_jobs(server.url, {}, jobs[WARMUP_REQUESTS:], CONCURRENCY))
        after = wait_idle(server.url, {})
        duration = time.monotonic() - start
        rss_end = rss_bytes(pids)
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert server.stop() == 0, server.log()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()

    llm = LLM(model_path, tokenizer=smollm2_path, num_kv_blocks=512)
    problems = check(jobs, outcomes, references(llm, jobs))
    summary = summarize(jobs, outcomes, problems, before, after, duration)
    print(summary | {"rss_growth_mib": (rss_end - rss_warm) / 2**20})
    assert problems == []
    assert summary["leaked_blocks"] == 0
    assert summary["preemptions"] > 0  # the KV cache really was too small
    assert summary["requests_invalid"] > 20 and summary["checked_against_offline"] > 100
    assert summary["cut_by_client"] > 20 and summary["aborted_in_server"] >= summary["cut_by_client"] * 0.8
    assert rss_end - rss_warm < MAX_RSS_GROWTH, f"RSS grew {(rss_end - rss_warm) / 2**20:.1f} MiB"
    assert "Traceback" not in server.log()
