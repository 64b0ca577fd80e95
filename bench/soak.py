"""Soak test: a live `nanoinfer serve` under many concurrent clients with random
prompts, lengths and sampling parameters, some requests invalid, some clients
disconnecting mid-stream, some giving up on non-streaming requests, and a KV
cache small enough that requests get preempted. Afterwards every valid request
must have a complete answer (greedy and seeded ones equal to the offline `LLM`
for the same prompt and parameters), every invalid one its 4xx, no KV block
may be left in use, and the server and core processes must not have grown.

    python bench/soak.py --num-requests 3000 --concurrency 64          # a tiny random Llama, a few minutes
    python bench/soak.py --model /path/to/model --num-kv-blocks 256 --json-out soak.json

tests/test_soak.py runs the same workload, smaller, in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_NAME = "soak"
# Kinds of request and their share of the workload (the rest are plain valid requests).
INVALID, DISCONNECT, ABORT = 0.12, 0.08, 0.06
_WORDS = ("the cat sat on a mat while seven ships sailed north into grey weather; "
          "numbers 12 345 and unicode: café, naïve, 東京, emoji 🙂 — done.").split(" ")


@dataclass
class Job:
    """One request of the workload and what its answer must be."""

    kind: str  # "valid", "invalid", "disconnect" (stream closed after a few events), "abort" (client gives up)
    path: str
    body: dict | bytes
    expected_status: int = 200
    give_up_after: float = 0.0  # "abort": seconds before the client cancels
    events_before_close: int = 0  # "disconnect"

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and bool(self.body.get("stream"))

    @property
    def checks_reference(self) -> bool:
        """Greedy and seeded answers are reproducible: they must equal the offline engine's."""
        b = self.body
        return self.kind == "valid" and (b.get("temperature") == 0 or b.get("seed") is not None)


@dataclass
class Outcome:
    status: int = 0
    texts: dict[int, str] = field(default_factory=dict)  # by choice index
    finish_reasons: dict[int, str | None] = field(default_factory=dict)
    usage: dict | None = None
    num_tokens: dict[int, int] = field(default_factory=dict)  # from logprobs, when asked
    error: str = ""
    cut: bool = False  # the client closed or cancelled before the end
    seconds: float = 0.0


# ----- the workload -----


def _text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def _valid_body(rng: random.Random) -> tuple[str, dict]:
    chat = rng.random() < 0.25
    body: dict = {"model": MODEL_NAME, "max_tokens": rng.randint(1, 32)}
    if chat:
        body["messages"] = [{"role": "user", "content": _text(rng, rng.randint(1, 40))}]
        if rng.random() < 0.5:
            body["max_completion_tokens"] = body.pop("max_tokens")
    elif rng.random() < 0.3:
        body["prompt"] = [rng.randrange(1, 49000) for _ in range(rng.randint(1, 120))]
    else:
        body["prompt"] = _text(rng, rng.randint(1, 60))
    mode = rng.random()
    if mode < 0.5:
        body["temperature"] = 0
    elif mode < 0.75:
        body |= {"temperature": rng.choice([0.5, 1.0, 1.5]), "seed": rng.randrange(1 << 31)}
    else:
        body["temperature"] = rng.choice([0.7, 1.0])
    if rng.random() < 0.15:  # top-p sorts the whole vocabulary of every row in the batch: costly on CPU
        body["top_p"] = rng.choice([0.5, 0.9])
    if rng.random() < 0.3:
        body["top_k"] = rng.choice([1, 5, 50])
    if rng.random() < 0.2:
        body["n"] = rng.randint(2, 3)
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    if rng.random() < 0.15:
        body["stop"] = [rng.choice(["e", " the", "a", "."])]
    if rng.random() < 0.15:
        if chat:
            body |= {"logprobs": True, "top_logprobs": rng.randint(0, 5)}
        else:
            body["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.05:
        body["repetition_penalty"] = 1.2
    if rng.random() < 0.5:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def _invalid_job(rng: random.Random, max_body_bytes: int, max_output_tokens: int) -> Job:
    ok = {"model": MODEL_NAME, "prompt": _text(rng, 5), "max_tokens": 4}
    cases = [
        ("/v1/completions", ok | {"temperature": -1}, 400),
        ("/v1/completions", ok | {"top_p": 0}, 400),
        ("/v1/completions", ok | {"n": 0}, 400),
        ("/v1/completions", ok | {"logprobs": 21}, 400),
        ("/v1/completions", ok | {"max_tokens": 10**6}, 400),
        ("/v1/completions", ok | {"n": 8, "max_tokens": max_output_tokens // 8 + 1}, 400),
        ("/v1/completions", ok | {"prompt": []}, 400),
        ("/v1/completions", ok | {"prompt": [10**9]}, 400),
        ("/v1/completions", ok | {"model": "../../etc/passwd"}, 404),
        ("/v1/completions", b'{"prompt": "unterminated', 400),
        ("/v1/completions", ok | {"prompt": "x" * max_body_bytes}, 413),
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, 400),
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                                  "logprobs": True, "top_logprobs": 21}, 400),
        ("/v1/no-such-endpoint", ok, 404),
    ]
    path, body, status = rng.choice(cases)
    return Job("invalid", path, body, status)


def make_jobs(num_requests: int, seed: int, max_body_bytes: int, max_output_tokens: int) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for _ in range(num_requests):
        roll = rng.random()
        if roll < INVALID:
            jobs.append(_invalid_job(rng, max_body_bytes, max_output_tokens))
            continue
        path, body = _valid_body(rng)
        if roll < INVALID + DISCONNECT:
            body |= {"stream": True, "ignore_eos": True, "max_tokens": rng.randint(100, 300)}
            body.pop("max_completion_tokens", None)
            jobs.append(Job("disconnect", path, body, events_before_close=rng.randint(1, 4)))
        elif roll < INVALID + DISCONNECT + ABORT:
            body |= {"stream": False, "ignore_eos": True, "max_tokens": rng.randint(100, 300)}
            body.pop("max_completion_tokens", None)
            body.pop("stream_options", None)
            jobs.append(Job("abort", path, body, give_up_after=rng.uniform(0.05, 0.5)))
        else:
            jobs.append(Job("valid", path, body))
    return jobs


# ----- running it -----


def _absorb_choice(outcome: Outcome, choice: dict, chat: bool, streamed: bool) -> None:
    index = choice["index"]
    if chat:
        text = (choice["delta"] if streamed else choice["message"]).get("content") or ""
        logprobs = (choice.get("logprobs") or {}).get("content")
    else:
        text = choice["text"]
        logprobs = (choice.get("logprobs") or {}).get("tokens")
    outcome.texts[index] = outcome.texts.get(index, "") + text
    if logprobs is not None:
        outcome.num_tokens[index] = outcome.num_tokens.get(index, 0) + len(logprobs)
    if choice.get("finish_reason") is not None or index not in outcome.finish_reasons:
        outcome.finish_reasons[index] = choice.get("finish_reason")


async def _send(http: httpx.AsyncClient, url: str, job: Job) -> Outcome:
    outcome = Outcome()
    chat = job.path.startswith("/v1/chat")
    kw = {"content": job.body} if isinstance(job.body, bytes) else {"json": job.body}
    async with http.stream("POST", url + job.path, **kw) as response:
        outcome.status = response.status_code
        if response.status_code != 200 or not job.stream:
            data = json.loads(await response.aread())
            if response.status_code != 200:
                outcome.error = data.get("error", {}).get("message", "")
                return outcome
            for choice in data["choices"]:
                _absorb_choice(outcome, choice, chat, streamed=False)
            outcome.usage = data["usage"]
            return outcome
        num_events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                return outcome
            chunk = json.loads(payload)
            if "error" in chunk:
                outcome.error = chunk["error"]["message"]
                continue
            for choice in chunk["choices"]:
                _absorb_choice(outcome, choice, chat, streamed=True)
            if chunk.get("usage"):
                outcome.usage = chunk["usage"]
            num_events += 1
            if job.kind == "disconnect" and num_events >= job.events_before_close:
                outcome.cut = True
                return outcome  # leaving the block closes the connection mid-stream
        outcome.error = outcome.error or "the stream ended without [DONE]"
        return outcome


async def run_job(http: httpx.AsyncClient, url: str, job: Job) -> Outcome:
    start = time.monotonic()
    try:
        if job.kind == "abort":
            try:
                outcome = await asyncio.wait_for(_send(http, url, job), job.give_up_after)
            except asyncio.TimeoutError:
                outcome = Outcome(cut=True)
        else:
            outcome = await _send(http, url, job)
    except (httpx.HTTPError, ValueError) as e:
        outcome = Outcome(error=f"{type(e).__name__}: {e}")
    outcome.seconds = time.monotonic() - start
    return outcome


async def run_jobs(url: str, headers: dict, jobs: list[Job], concurrency: int) -> list[Outcome]:
    """Every job, at most `concurrency` at a time, in order of submission."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(300), limits=limits) as http:
        async def limited(job: Job) -> Outcome:
            async with semaphore:
                return await run_job(http, url, job)

        return list(await asyncio.gather(*(limited(job) for job in jobs)))


# ----- checking it -----


def sampling_params(job: Job):
    """The job's body as the offline engine's SamplingParams (what the server derives from it)."""
    from nanoinfer import SamplingParams

    b = job.body
    names = ("n", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "repetition_penalty")
    given = {name: b[name] for name in names if name in b}
    logprobs = b.get("top_logprobs", 0) if b.get("logprobs") is True else b.get("logprobs")
    return SamplingParams(max_tokens=b.get("max_completion_tokens", b.get("max_tokens")), logprobs=logprobs, **given)


def references(llm, jobs: list[Job]) -> dict[int, list[str]]:
    """Offline texts (per choice) of the jobs whose answers are reproducible, by job index."""
    refs = {}
    # On CPU a top-p row makes the sampler sort every row's vocabulary: those go in a batch of their own.
    for with_top_p in (False, True):
        picked = [i for i, job in enumerate(jobs) if job.checks_reference and ("top_p" in job.body) == with_top_p]
        prompts = [jobs[i].body["prompt"] if "prompt" in jobs[i].body else
                   llm.apply_chat_template(jobs[i].body["messages"]) for i in picked]
        outputs = llm.generate(prompts, [sampling_params(jobs[i]) for i in picked], use_tqdm=False)
        refs |= {i: [c.text for c in out.outputs] for i, out in zip(picked, outputs)}
    return refs


def check(jobs: list[Job], outcomes: list[Outcome], refs: dict[int, list[str]]) -> list[str]:
    """Every problem found, one line each (empty: all answers were right)."""
    problems = []
    for i, (job, out) in enumerate(zip(jobs, outcomes)):
        where = f"job {i} ({job.kind} {job.path})"
        if job.kind == "invalid":
            if out.status != job.expected_status or not out.error:
                problems.append(f"{where}: expected {job.expected_status} with an error, got {out.status} {out.error!r}")
            continue
        if job.kind in ("disconnect", "abort"):
            if not out.cut and (out.status != 200 or out.error):
                problems.append(f"{where}: {out.status} {out.error!r}")
            continue
        n = job.body.get("n", 1)
        if out.status != 200 or out.error:
            problems.append(f"{where}: {out.status} {out.error!r}")
            continue
        if sorted(out.finish_reasons) != list(range(n)) or any(f not in ("stop", "length") for f in out.finish_reasons.values()):
            problems.append(f"{where}: incomplete, finish reasons {out.finish_reasons}")
            continue
        max_tokens = job.body.get("max_completion_tokens", job.body.get("max_tokens"))
        if out.usage is not None and out.usage["completion_tokens"] > n * max_tokens:
            problems.append(f"{where}: {out.usage['completion_tokens']} tokens for n={n} x max_tokens={max_tokens}")
        if out.num_tokens and any(count > max_tokens for count in out.num_tokens.values()):
            problems.append(f"{where}: logprobs for more than max_tokens={max_tokens} tokens: {out.num_tokens}")
        if i in refs and [out.texts.get(c, "") for c in range(n)] != refs[i]:
            problems.append(f"{where}: {[out.texts.get(c, '') for c in range(n)]!r} != offline {refs[i]!r}")
    return problems


def metrics(url: str, headers: dict) -> dict[str, float]:
    """The server's unlabelled gauges and counters, plus request_success_total per finish reason."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", headers=headers, timeout=30).text):
        for sample in family.samples:
            name = sample.name.removeprefix("nanoinfer:")
            reason = sample.labels.get("finished_reason")
            values[f"{name}{{{reason}}}" if reason else name] = sample.value
    return values


def wait_idle(url: str, headers: dict, timeout: float = 60) -> dict[str, float]:
    """The metrics once nothing runs or waits (aborts reach the core asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(url, headers)
        idle = values["num_requests_running"] == values["num_requests_waiting"] == values["kv_cache_blocks_in_use"] == 0
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


def rss_bytes(pids: list[int]) -> int:
    import psutil

    return sum(psutil.Process(pid).memory_info().rss for pid in pids)


def server_pids(proc_pid: int) -> list[int]:
    """The API process and its engine core (not multiprocessing's resource tracker)."""
    import psutil

    children = [c.pid for c in psutil.Process(proc_pid).children()
                if any("spawn_main" in part for part in c.cmdline())]
    return [proc_pid, *children]


def summarize(jobs: list[Job], outcomes: list[Outcome], problems: list[str], before: dict, after: dict,
              duration: float) -> dict:
    kinds = {kind: sum(job.kind == kind for job in jobs) for kind in ("valid", "invalid", "disconnect", "abort")}
    return {
        "requests": len(jobs), **{f"requests_{kind}": count for kind, count in kinds.items()},
        "completed_ok": sum(job.kind == "valid" and out.status == 200 and not out.error for job, out in zip(jobs, outcomes)),
        "checked_against_offline": sum(job.checks_reference for job in jobs),
        "cut_by_client": sum(out.cut for out in outcomes),
        "errors": len(problems), "error_rate": len(problems) / max(len(jobs), 1),
        "preemptions": after["num_preemptions_total"] - before.get("num_preemptions_total", 0),
        "aborted_in_server": after.get("request_success_total{abort}", 0) - before.get("request_success_total{abort}", 0),
        "leaked_blocks": after["kv_cache_blocks_in_use"],
        "duration_s": round(duration, 1), "requests_per_s": round(len(jobs) / duration, 1),
    }


# ----- the script -----


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: a tiny random Llama, SmolLM2's vocabulary)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the embedded SmolLM2's)")
    parser.add_argument("--num-requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-kv-blocks", type=int, default=64, help="small, so that requests get preempted")
    parser.add_argument("--rounds", type=int, default=3, help="the requests go in this many rounds; RSS is taken after each")
    parser.add_argument("--max-rss-growth-mib", type=float, default=64.0,
                        help="allowed growth of server + core RSS from the end of the first round to the last")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    sys.path.insert(0, REPO_ROOT)
    sys.path.insert(0, os.path.join(REPO_ROOT, "tests"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from conftest import make_tiny_model
    from serving import launch_server

    from nanoinfer import LLM
    from nanoinfer.loader.default_model import default_model_path

    tokenizer = args.tokenizer or default_model_path()
    model = args.model or make_tiny_model(os.path.join(tempfile.mkdtemp(prefix="soak-"), "tiny"), "llama",
                                          vocab_size=49152)
    max_body, max_output = 200_000, 4096
    proc, url = launch_server([model, "--tokenizer", tokenizer, "--served-model-name", MODEL_NAME,
                               "--num-kv-blocks", str(args.num_kv_blocks), "--max-request-body-bytes", str(max_body),
                               "--max-output-tokens-per-request", str(max_output), "--log-stats-interval", "0"], 600)
    try:
        pids = server_pids(proc.pid)
        jobs = make_jobs(args.num_requests, args.seed, max_body, max_output)
        before = metrics(url, {})
        outcomes, rss = [], []
        start = time.monotonic()
        per_round = -(-len(jobs) // args.rounds)
        for r in range(args.rounds):
            outcomes += asyncio.run(run_jobs(url, {}, jobs[r * per_round:(r + 1) * per_round], args.concurrency))
            wait_idle(url, {})
            rss.append(rss_bytes(pids))
            print(f"round {r + 1}/{args.rounds}: {len(outcomes)} requests, RSS {rss[-1] / 2**20:.0f} MiB", flush=True)
        duration = time.monotonic() - start
        after = wait_idle(url, {})
        healthy = httpx.get(f"{url}/health").status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=1024)
    problems = check(jobs, outcomes, references(llm, jobs))
    summary = summarize(jobs, outcomes, problems, before, after, duration) | {
        "concurrency": args.concurrency, "num_kv_blocks": args.num_kv_blocks, "healthy_after": healthy,
        "rss_mib_per_round": [round(x / 2**20, 1) for x in rss],
        "rss_growth_mib": round((rss[-1] - rss[0]) / 2**20, 1)}
    for problem in problems[:20]:
        print("PROBLEM", problem)
    print(json.dumps(summary, indent=2))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=2)
    failed = problems or summary["leaked_blocks"] or not healthy or summary["rss_growth_mib"] > args.max_rss_growth_mib
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
