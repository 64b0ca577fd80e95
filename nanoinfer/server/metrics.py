"""Prometheus metrics under vLLM's names (prefix `nanoinfer:`), plus the
periodic one-line log. Request timings are taken in the API process, as the
client sees them; queue times and scheduler state come from the core."""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from nanoinfer.outputs import EngineCoreOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0,
                    160.0, 320.0, 640.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                          0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0)


@dataclass
class _RequestTimes:
    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    last_token: float = 0.0


class ServerMetrics:
    def __init__(self, model_name: str, max_loras: int | None = None) -> None:
        """`max_loras`: the engine serves LoRA adapters (enable_lora) in that many slots; None: it serves none."""
        self.registry = CollectorRegistry()
        label = {"model_name": model_name}

        def make(kind, name: str, doc: str, labels: tuple[str, ...] = (), **kw):
            metric = kind(f"nanoinfer:{name}", doc, ["model_name", *labels], registry=self.registry, **kw)
            return metric if labels else metric.labels(**label)

        self.num_requests_running = make(Gauge, "num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = make(Gauge, "num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = make(Gauge, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.kv_cache_blocks_in_use = make(Gauge, "kv_cache_blocks_in_use", "KV-cache blocks held by requests.")
        # The core's counters are cumulative; Prometheus gets their increments.
        self.core_counters = {
            "prefix_cache_queries": make(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            "prefix_cache_hits": make(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
            "num_preemptions": make(Counter, "num_preemptions", "Requests preempted (their KV cache dropped)."),
            "spec_decode_num_drafts": make(Counter, "spec_decode_num_drafts",
                                           "Speculative decoding: request steps that checked draft tokens."),
            "spec_decode_num_draft_tokens": make(Counter, "spec_decode_num_draft_tokens",
                                                 "Speculative decoding: draft tokens checked."),
            "spec_decode_num_accepted_tokens": make(Counter, "spec_decode_num_accepted_tokens",
                                                    "Speculative decoding: draft tokens kept."),
        }
        self.spec_accepted_per_pos = make(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                          "Speculative decoding: draft tokens kept, by their position in the step.",
                                          ("position",))
        self._accepted_per_pos: list[int] = []
        # vLLM's: one sample whose labels name the adapters in use, its value the time they were read.
        self.lora_requests_info = None if max_loras is None else Gauge(
            "nanoinfer:lora_requests_info", "LoRA adapters of running and waiting requests (labels), and when.",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=self.registry)
        self._max_loras = max_loras
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = make(Counter, "generation_tokens", "Generated tokens.")
        self._request_success = make(Counter, "request_success", "Finished requests, by finish reason.",
                                     ("finished_reason",))
        self._label = label
        self.time_to_first_token = make(Histogram, "time_to_first_token_seconds", "Arrival to first token.",
                                        buckets=_LATENCY_BUCKETS)
        self.inter_token_latency = make(Histogram, "inter_token_latency_seconds", "Time between successive tokens.",
                                        buckets=_TOKEN_LATENCY_BUCKETS)
        self.e2e_request_latency = make(Histogram, "e2e_request_latency_seconds", "Arrival to last token.",
                                        buckets=_LATENCY_BUCKETS)
        self.request_queue_time = make(Histogram, "request_queue_time_seconds", "Arrival to first scheduling.",
                                       buckets=_LATENCY_BUCKETS)
        self._requests: dict[str, _RequestTimes] = {}  # by child request id
        self._core_totals = dict.fromkeys(self.core_counters, 0)
        self._stats: dict = {}
        # Totals at the last log line, for its rates.
        self._num_prompt_tokens = self._num_generation_tokens = 0
        self._logged = (time.monotonic(), 0, 0)
        self._logged_drafts = (0, 0, 0)  # speculative decoding's (drafts, draft tokens, kept) at the last log line

    # ----- per request -----

    def start_request(self, child_id: str, arrival: float, num_prompt_tokens: int) -> None:
        self._requests[child_id] = _RequestTimes(arrival, num_prompt_tokens)

    def observe_queue_time(self, seconds: float) -> None:
        self.request_queue_time.observe(max(seconds, 0.0))

    def on_outputs(self, outputs: list[EngineCoreOutput], now: float, finish_reasons: dict[str, str]) -> None:
        """`finish_reasons`: the requests the output processor ended (stop strings, failed detokenization), with
        the reason their clients see, which wins over the core's."""
        for out in outputs:
            times = self._requests.get(out.request_id)
            if times is None:
                continue
            num_new = len(out.new_token_ids)
            self.generation_tokens.inc(num_new)
            self._num_generation_tokens += num_new
            if times.first_token is None:
                times.first_token = now
                self.time_to_first_token.observe(now - times.arrival)
                self.prompt_tokens.inc(times.num_prompt_tokens)
                self._num_prompt_tokens += times.num_prompt_tokens
            elif num_new:
                self.inter_token_latency.observe((now - times.last_token) / num_new)
            times.last_token = now
            finish_reason = finish_reasons.get(out.request_id, out.finish_reason)
            if finish_reason is not None:
                self.finish_request(out.request_id, finish_reason, now)

    def finish_request(self, child_id: str, finish_reason: str, now: float) -> None:
        """Counts a request once, whichever way it ends (token stop, stop string, abort)."""
        times = self._requests.pop(child_id, None)
        if times is None:
            return
        self._request_success.labels(finished_reason=finish_reason, **self._label).inc()
        self.e2e_request_latency.observe(now - times.arrival)

    # ----- scheduler state from the core -----

    def on_core_stats(self, stats: dict, num_blocks: int) -> None:
        self._stats = stats
        self.num_requests_running.set(stats["num_running"])
        self.num_requests_waiting.set(stats["num_waiting"])
        self.kv_cache_usage_perc.set(stats["kv_cache_usage"])
        self.kv_cache_blocks_in_use.set(round(stats["kv_cache_usage"] * num_blocks))
        for name, counter in self.core_counters.items():
            increment = stats[name] - self._core_totals[name]
            if increment > 0:
                counter.inc(increment)
            self._core_totals[name] = stats[name]
        for position, total in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"]):
            before = self._accepted_per_pos[position] if position < len(self._accepted_per_pos) else 0
            if total > before:
                self.spec_accepted_per_pos.labels(position=str(position), **self._label).inc(total - before)
        self._accepted_per_pos = list(stats["spec_decode_num_accepted_tokens_per_pos"])
        if self.lora_requests_info is not None:  # only the current adapters: older label sets go
            self.lora_requests_info.clear()
            self.lora_requests_info.labels(max_lora=str(self._max_loras),
                                           running_lora_adapters=",".join(stats["running_lora_adapters"]),
                                           waiting_lora_adapters=",".join(stats["waiting_lora_adapters"])
                                           ).set_to_current_time()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def log_line(self) -> str | None:
        """Throughput since the last call plus the scheduler's state; None when idle throughout."""
        now = time.monotonic()
        last_time, last_prompt, last_generation = self._logged
        prompt, generation = self._num_prompt_tokens - last_prompt, self._num_generation_tokens - last_generation
        running, waiting = self._stats.get("num_running", 0), self._stats.get("num_waiting", 0)
        self._logged = (now, self._num_prompt_tokens, self._num_generation_tokens)
        if not (prompt or generation or running or waiting):
            return None
        elapsed = max(now - last_time, 1e-9)
        queries = self._core_totals["prefix_cache_queries"]
        hit_rate = self._core_totals["prefix_cache_hits"] / queries if queries else 0.0
        line = (f"prompt throughput: {prompt / elapsed:.1f} tok/s, generation throughput: "
                f"{generation / elapsed:.1f} tok/s, running: {running} reqs, waiting: {waiting} reqs, "
                f"KV cache usage: {100 * self._stats.get('kv_cache_usage', 0.0):.1f}%, "
                f"prefix cache hit rate: {100 * hit_rate:.1f}%")
        totals = tuple(self._core_totals[f"spec_decode_num_{name}"] for name in ("drafts", "draft_tokens",
                                                                                  "accepted_tokens"))
        steps, drafted, kept = (total - last for total, last in zip(totals, self._logged_drafts))
        self._logged_drafts = totals
        if drafted:  # as vLLM logs it: the share of drafts kept, and tokens per drafted step
            line += (f", draft acceptance rate: {100 * kept / drafted:.1f}%, mean acceptance length: "
                     f"{1 + kept / steps:.2f}")
        return line
