"""Serving benchmark: random prompts streamed through /v1/completions with
Poisson arrivals; request/token throughput and TTFT / TPOT / ITL.

The load and metrics follow `vllm bench serve --dataset-name random`: with
--tokenizer, each prompt is random token ids decoded to text and re-encoded to
--input-len tokens, sent as text (the server tokenizes it); without, the ids
themselves. No temperature is sent (the server's default, as vLLM's client).
Arrival times are Poisson, rescaled so the last request is sent at
num_prompts / rate. TTFT is the time to the first streamed chunk, ITL the
gaps between successive chunks, e2e the time to the last chunk with tokens,
TPOT = (e2e - TTFT) / (output_tokens - 1), with output tokens counted by the
final `usage` chunk (a stream without one is a failed request).

    python bench/serving.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8
    python bench/serving.py --num-prompts 32 --launch-server -- --kv-cache-memory-bytes 268435456
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import httpx
import numpy as np


@dataclass
class RequestResult:
    prompt_len: int
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0


async def send_request(http: httpx.AsyncClient, url: str, body: dict, prompt_len: int, headers: dict
                       ) -> RequestResult:
    result = RequestResult(prompt_len)
    start = last = time.perf_counter()
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("error"):
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("choices"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                elif chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
        result.latency = last - start
        result.ok = result.ttft > 0 and result.output_tokens > 0
        if result.ttft > 0 and not result.output_tokens:
            result.error = "the stream had no usage chunk"
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


Prompt = tuple[str | list[int], int]  # what is sent, and its length in tokens


def workload(args: argparse.Namespace) -> tuple[list[Prompt], Prompt, list[float]]:
    """The prompts, the warm-up's own prompt (so it leaves no prefix-cache hits behind) and each request's send
    time after the start: 0 for all at once, else Poisson arrivals at --request-rate, rescaled as vLLM's client
    rescales them (the last at num_prompts / rate: the load asked for, not a draw's 1-3% off it)."""
    rng = random.Random(args.seed)
    tokenizer = None
    if args.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab_size = args.vocab_size if tokenizer is None else len(tokenizer)
    *prompts, warmup_prompt = [_prompt([rng.randrange(vocab_size) for _ in range(args.input_len)], tokenizer, rng)
                               for _ in range(args.num_prompts + 1)]
    offsets = [0.0] * len(prompts)
    if args.request_rate != float("inf") and prompts:
        t = 0.0
        for i in range(len(prompts)):
            t += rng.expovariate(args.request_rate)
            offsets[i] = t
        offsets = [o * (len(prompts) / args.request_rate) / t for o in offsets]
    return prompts, warmup_prompt, offsets


def _prompt(token_ids: list[int], tokenizer, rng: random.Random) -> Prompt:
    """Token ids as they are, or (with a tokenizer) as text of the same number of tokens: decoded, encoded again
    (decoding merges and splits tokens), cut or topped up with more random ids, a few times, as vLLM's random
    dataset does (`gen_prompt_decode_to_target_len`)."""
    if tokenizer is None:
        return token_ids, len(token_ids)
    target = len(token_ids)
    for _ in range(10):
        text = tokenizer.decode(token_ids)
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == target:
            break
        token_ids = encoded[:target] + [rng.randrange(len(tokenizer)) for _ in range(target - len(encoded))]
    return text, len(encoded)


def request_body(model: str, prompt: str | list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


def http_client() -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits)


async def warm_up(url: str, headers: dict, model: str | None, prompt: Prompt) -> str:
    """The model name to send (the server's first unless given), after one short request."""
    async with http_client() as http:
        model = model or (await http.get(f"{url}/v1/models", headers=headers)).json()["data"][0]["id"]
        result = await send_request(http, url, request_body(model, prompt[0], 4), prompt[1], headers)
    if not result.ok:
        raise RuntimeError(f"the warm-up request failed: {result.error}")
    return model


async def run_client(url: str, headers: dict, bodies: list[tuple[dict, int]], offsets: list[float], start: float,
                     max_concurrency: int | None) -> tuple[list[RequestResult], float]:
    """Send each (body, prompt length) at `start` (time.monotonic) + its offset, at most max_concurrency in
    flight; the results and when the last one ended."""
    semaphore = asyncio.Semaphore(max_concurrency or len(bodies) or 1)
    async with http_client() as http:

        async def one(body: dict, prompt_len: int, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            async with semaphore:
                return await send_request(http, url, body, prompt_len, headers)

        results = await asyncio.gather(*(one(body, n, offset) for (body, n), offset in zip(bodies, offsets)))
    return list(results), time.monotonic()


def client_process(*call_args) -> tuple[list[RequestResult], float]:
    """One load-generating process of --num-clients (its own event loop and connections)."""
    return asyncio.run(run_client(*call_args))


def run_benchmark(args: argparse.Namespace, url: str, headers: dict) -> tuple[list[RequestResult], float]:
    """The load from --num-clients processes (one: this one, as `vllm bench serve`); request i goes to client
    i mod n, on one shared schedule. Duration: from the schedule's start to the last request's end."""
    prompts, warmup_prompt, offsets = workload(args)
    model = asyncio.run(warm_up(url, headers, args.model, warmup_prompt))
    bodies = [(request_body(model, prompt, args.output_len), prompt_len) for prompt, prompt_len in prompts]
    n = args.num_clients
    concurrency = -(-args.max_concurrency // n) if args.max_concurrency else None
    if n == 1:
        start = time.monotonic()
        results, end = client_process(url, headers, bodies, offsets, start, concurrency)
        return results, end - start
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(time.sleep, [0.2] * n))  # every process started and imported before the clock starts
        start = time.monotonic() + 0.1
        parts = [pool.submit(client_process, url, headers, bodies[i::n], offsets[i::n], start, concurrency)
                 for i in range(n)]
        outcomes = [part.result() for part in parts]
    return [r for results, _ in outcomes for r in results], max(end for _, end in outcomes) - start


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]

    def ms(values: list[float]) -> dict:
        if not values:
            return {"mean": 0.0, "median": 0.0, "p99": 0.0}
        return {"mean": float(np.mean(values)) * 1e3, "median": float(np.median(values)) * 1e3,
                "p99": float(np.percentile(values, 99)) * 1e3}

    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": ms([r.ttft for r in ok]),
        "tpot_ms": ms([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "itl_ms": ms([gap for r in ok for gap in r.itl]),
        "e2e_latency_ms": ms([r.latency for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


def print_table(summary: dict) -> None:
    rows = [("Successful requests", summary["completed"]), ("Failed requests", summary["failed"]),
            ("Benchmark duration (s)", summary["duration_s"]), ("Total input tokens", summary["total_input_tokens"]),
            ("Total output tokens", summary["total_output_tokens"]),
            ("Request throughput (req/s)", summary["request_throughput"]),
            ("Output token throughput (tok/s)", summary["output_throughput"]),
            ("Total token throughput (tok/s)", summary["total_token_throughput"])]
    for key, title in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_latency_ms", "E2E latency")):
        rows += [(f"{stat.capitalize()} {title} (ms)", summary[key][stat]) for stat in ("mean", "median", "p99")]
    print("=" * 50 + "\n" + "Serving Benchmark Result".center(50) + "\n" + "=" * 50)
    for name, value in rows:
        print(f"{name:<36}{value:>14.2f}" if isinstance(value, float) else f"{name:<36}{value:>14}")
    print("=" * 50)
    for error in summary["errors"]:
        print(f"error: {error}")


def launch_server(serve_args: list[str], timeout: float) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "nanoinfer.cli", "serve", "--port", str(port), "--no-access-log", *serve_args]
    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(cmd, cwd=repo_root, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not become healthy within {timeout:.0f} s")


def main() -> None:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--launch-server", action="store_true",
                        help="start `nanoinfer serve` with the arguments after `--` (MODEL first, if any)")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--api-key", default=os.environ.get("NANOINFER_API_KEY"))
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens per request (ignore_eos)")
    parser.add_argument("--vocab-size", type=int, default=10000,
                        help="without --tokenizer, prompt token ids are drawn from [0, this)")
    parser.add_argument("--tokenizer", default=None,
                        help="send text prompts, as vllm bench serve does: random ids of this tokenizer's vocabulary, "
                             "decoded, at --input-len tokens (the server's tokenizer should be the same)")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="mean requests per second, Poisson arrivals (inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--num-clients", type=int, default=1,
                        help="load-generating processes: one (as vllm bench serve) saturates its core before a fast "
                             "server does at high rates; more split the requests round-robin on one schedule")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-timeout", type=float, default=600, help="seconds to wait for a launched server")
    parser.add_argument("--json-out", default=None, help="also write the numbers to this JSON file")
    args = parser.parse_args(argv)
    if args.request_rate <= 0:
        parser.error("--request-rate must be > 0")
    if args.num_clients < 1:
        parser.error("--num-clients must be >= 1")

    proc = None
    url = args.base_url
    if args.launch_server:
        proc, url = launch_server(serve_args, args.server_timeout)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        results, duration = run_benchmark(args, url.rstrip("/"), headers)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    summary = summarize(results, duration)
    print_table(summary)
    if args.json_out:
        config = {k: v for k, v in vars(args).items() if k != "api_key"}
        with open(args.json_out, "w") as f:
            json.dump({"config": config | {"request_rate": str(args.request_rate)}, **summary}, f, indent=2)


if __name__ == "__main__":
    main()
