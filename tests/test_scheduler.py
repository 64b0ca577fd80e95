"""The scheduler driven by a fake model runner.

The fake runner keeps per-request state from the scheduler's messages the way
the real one does and writes a shadow KV cache. Real K/V at a position depends
on every token up to it, so a shadow slot holds an id standing for (cache salt,
all tokens up to that position): a hit at the wrong position, across tenants,
on an unwritten or overwritten block, or two writers in one step all show up
when a request reads its context back. The runner samples a deterministic
token from the request's tokens, so a request's output depends only on its
prompt and a run with a tiny pool (many preemptions) must give exactly the
tokens of a run with a large one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from nanoinfer.config import EngineConfig
from nanoinfer.kv_cache.block_pool import BlockPool
from nanoinfer.lora.request import LoRARequest
from nanoinfer.outputs import ModelRunnerOutput
from nanoinfer.request import Request, RequestStatus
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.scheduler.output import SchedulerOutput
from nanoinfer.scheduler.scheduler import Scheduler

VOCAB = 23
EOS = 0


def sample(token_ids: list[int]) -> int:
    """Position-weighted so outputs are not a short cycle and EOS shows up mid-sequence."""
    return sum(i * t for i, t in enumerate(token_ids, 1)) % VOCAB


def copy_sample(token_ids: list[int]) -> int:
    """Repeats the token three back: the output continues a cycle n-gram drafts predict (speculative decoding's
    drafts are then mostly kept, where under `sample` they are mostly rejected)."""
    return token_ids[-3] if len(token_ids) >= 3 else token_ids[-1]


SAMPLERS = {"mix": sample, "copy": copy_sample}


def reference_output(prompt: list[int], max_tokens: int, max_model_len: int, ignore_eos: bool,
                     sampler: Callable[[list[int]], int] = sample) -> tuple[list[int], str]:
    """What any correct schedule must produce for one request under `sampler`."""
    tokens, out = list(prompt), []
    while True:
        token = sampler(tokens)
        tokens.append(token)
        out.append(token)
        if token == EOS and not ignore_eos:
            return out, "stop"
        if len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out, "length"


class PrefixIds:
    """Interns (salt, token prefix) as small ints: ids[p] stands for the salt and tokens[: p + 1]."""

    def __init__(self) -> None:
        self._trie: dict[tuple, int] = {}

    def extend(self, ids: list[int], salt: str | None, token_ids: list[int]) -> list[int]:
        for token in token_ids[len(ids) :]:
            ids.append(self._trie.setdefault((ids[-1] if ids else ("salt", salt), token), len(self._trie)))
        return ids


@dataclass
class RunnerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    salt: str | None
    prefix_ids: list[int] = field(default_factory=list)


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int, salt_of: Callable[[str], str | None],
                 prefix_ids: PrefixIds, sampler: Callable[[list[int]], int] = sample) -> None:
        self.sampler = sampler
        self.block_size = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.states: dict[str, RunnerState] = {}
        self.salt_of = salt_of  # the runner is not told salts; the test knows them
        self.prefix_ids = prefix_ids

    def slot(self, state: RunnerState, position: int) -> tuple[int, int]:
        return state.block_ids[position // self.block_size], position % self.block_size

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.states.pop(req_id, None)
        for new in out.new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent as new twice"
            self.states[new.req_id] = RunnerState(list(new.all_token_ids), list(new.block_ids), new.num_computed_tokens,
                                                  self.salt_of(new.req_id))
        for cached in out.cached_reqs:
            assert cached.req_id in self.states, f"{cached.req_id} scheduled but unknown to the runner (dropped?)"
            state = self.states[cached.req_id]
            assert cached.num_computed_tokens == state.num_computed_tokens, f"{cached.req_id}: computed count drifted"
            state.block_ids.extend(cached.new_block_ids)
        writers: dict[tuple[int, int], str] = {}
        sequences: dict[str, tuple[list[int], list[int]]] = {}  # each request's tokens + drafts, and their ids
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            drafts = out.scheduled_spec_tokens.get(req_id, [])
            end = state.num_computed_tokens + n
            assert end <= len(state.token_ids) + len(drafts), f"{req_id}: scheduled past its known tokens"
            assert not drafts or end == len(state.token_ids) + len(drafts), f"{req_id}: drafts not after its tokens"
            assert len(state.block_ids) * self.block_size >= end, f"{req_id}: no block for its tokens"
            self.prefix_ids.extend(state.prefix_ids, state.salt, state.token_ids)
            sequence = state.token_ids + drafts
            ids = self.prefix_ids.extend(list(state.prefix_ids), state.salt, sequence) if drafts else state.prefix_ids
            sequences[req_id] = sequence, ids
            for position in range(state.num_computed_tokens, end):
                block_id, offset = self.slot(state, position)
                assert (block_id, offset) not in writers, f"{writers[block_id, offset]} and {req_id} write one slot"
                writers[block_id, offset] = req_id
                self.kv[block_id][offset] = ids[position]
        # Attention runs after this step's writes: every context must read its own prefix.
        req_ids, sampled = [], []
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            sequence, ids = sequences[req_id]
            state.num_computed_tokens += n
            context = [self.kv[b][o] for b, o in (self.slot(state, p) for p in range(state.num_computed_tokens))]
            assert context == ids[: state.num_computed_tokens], f"{req_id} reads someone else's KV"
            if state.num_computed_tokens == len(sequence):
                # Speculative decoding: sample each draft's position, keep drafts while they equal the sample.
                known, new = len(state.token_ids), []
                for j in range(len(sequence) - known + 1):
                    new.append(self.sampler(sequence[: known + j]))
                    if known + j == len(sequence) or new[-1] != sequence[known + j]:
                        break
                state.num_computed_tokens -= len(sequence) - known - (len(new) - 1)  # rejected drafts' KV is stale
                state.token_ids.extend(new)
                req_ids.append(req_id)
                sampled.append(new)
        return ModelRunnerOutput(req_ids, sampled, [[None] * len(t) for t in sampled])


class PoolModel:
    """Reference LRU queue and ref counts, fed by the calls the manager makes on the pool."""

    def __init__(self, pool: BlockPool) -> None:
        self.queue = [b.block_id for b in pool.free_block_queue]
        self.refs = [b.ref_cnt for b in pool.blocks]
        touch, get_new_blocks, free_blocks = pool.touch, pool.get_new_blocks, pool.free_blocks

        def spy_touch(blocks):
            blocks = list(blocks)
            for b in blocks:
                if self.refs[b.block_id] == 0:
                    self.queue.remove(b.block_id)
                self.refs[b.block_id] += 1
            touch(blocks)

        def spy_get_new_blocks(num_blocks):
            new = get_new_blocks(num_blocks)
            assert [b.block_id for b in new] == self.queue[:num_blocks], "allocation did not take the LRU blocks"
            for b in new:
                self.refs[b.block_id] = 1
            del self.queue[:num_blocks]
            return new

        def spy_free_blocks(blocks):
            blocks = list(blocks)
            for b in blocks:
                self.refs[b.block_id] -= 1
                if self.refs[b.block_id] == 0:
                    self.queue.append(b.block_id)
            free_blocks(blocks)

        pool.touch, pool.get_new_blocks, pool.free_blocks = spy_touch, spy_get_new_blocks, spy_free_blocks

    def verify(self, pool: BlockPool) -> None:
        assert [b.block_id for b in pool.free_block_queue] == self.queue, "free queue is not in LRU order"
        assert [b.ref_cnt for b in pool.blocks] == self.refs


class Harness:
    """Scheduler + fake runner with every invariant checked after every operation."""

    def __init__(self, num_blocks: int, max_model_len: int = 1 << 20, sampler: str = "mix", **config) -> None:
        config.setdefault("block_size", 4)
        config.setdefault("async_scheduling", False)
        self.config = EngineConfig(**config)
        self.block_size = self.config.block_size
        self.max_model_len = max_model_len
        self.scheduler = Scheduler(self.config, num_blocks, max_model_len)
        self.pool = self.scheduler.kv_cache_manager.pool
        self.pool_model = PoolModel(self.pool)
        self.all_requests: dict[str, Request] = {}
        self.prefix_ids = PrefixIds()
        self.sampler = SAMPLERS[sampler]
        self.runner = FakeRunner(num_blocks, self.block_size, lambda r: self.prefix_key(self.all_requests[r]),
                                 self.prefix_ids, self.sampler)
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.finished_outside: set[str] = set()  # aborted or stopped by finish_requests
        self.reported_finished: Counter[str] = Counter()
        self.block_contents: dict[int, tuple[int, ...]] = {}  # prefix-cache key -> the block's prefix ids
        self._request_prefix_ids: dict[str, list[int]] = {}
        self.in_flight: ModelRunnerOutput | None = None  # async scheduling: the step whose tokens are not read yet
        self.num_hit_tokens = 0
        self.num_steps = 0
        self._arrival = 0

    @staticmethod
    def prefix_key(request: Request) -> tuple:
        """What KV depends on beside the tokens, as the shadow KV sees it: the tenant (salt) and the adapter."""
        return request.cache_salt, request.lora_int_id

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 8, *, priority: int = 0,
            cache_salt: str | None = None, ignore_eos: bool = True, lora: int = 0) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        self._arrival += 1
        request = Request(request_id, prompt, params, {EOS}, self.block_size, max_tokens, priority, cache_salt,
                          arrival_time=float(self._arrival),
                          lora_request=LoRARequest(f"adapter-{lora}", lora, "/adapters") if lora else None)
        self.scheduler.add_request(request)
        self.all_requests[request_id] = request
        self.outputs[request_id] = []
        self.check()
        return request

    def finish(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[Request]:
        finished = self.scheduler.finish_requests(request_ids, status)
        for request in finished:
            self.finish_reasons[request.request_id] = status.finish_reason
            self.finished_outside.add(request.request_id)
            assert request.request_id not in self.scheduler.kv_cache_manager.req_to_blocks
        self.check()
        return finished

    def step(self) -> SchedulerOutput:
        """schedule -> execute -> update; with async scheduling the update is the previous step's,
        as in EngineCore.step, so a request's newest token may still be in flight while it is planned."""
        scheduler, cfg = self.scheduler, self.config
        before = {r.request_id for r in scheduler.running}
        known = {r.request_id: r.num_tokens + r.num_output_placeholders for r in scheduler.running}
        last_in_flight = {r.request_id for r in scheduler.running
                          if r.num_output_tokens + r.num_output_placeholders >= r.max_tokens}
        preemptions = scheduler.num_preemptions
        out = scheduler.schedule()
        self.num_steps += 1
        self.reported_finished.update(out.finished_req_ids)
        scheduled = out.num_scheduled_tokens

        # Budget, batch size, order: running requests first, then new ones.
        assert 0 < min(scheduled.values(), default=1)
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(scheduled) <= cfg.max_num_seqs and len(scheduler.running) <= cfg.max_num_seqs
        assert not out.finished_req_ids & scheduled.keys(), "a request is both dropped and scheduled"
        order = [c.req_id for c in out.cached_reqs] + [n.req_id for n in out.new_reqs]
        assert list(scheduled) == order
        assert {c.req_id for c in out.cached_reqs} <= before
        assert not {n.req_id for n in out.new_reqs} & before
        for new in out.new_reqs:
            assert new.lora_request is self.all_requests[new.req_id].lora_request, "the runner must hear the adapter"
        if out.new_reqs:  # admitted only after every running request got its share, without preempting
            assert scheduler.num_preemptions == preemptions
            assert all(r.request_id in scheduled or r.request_id in last_in_flight for r in scheduler.running)
        # A request gets fewer tokens than it needs only when the budget ran out (chunking).
        start = {c.req_id: c.num_computed_tokens for c in out.cached_reqs}
        start.update({n.req_id: n.num_computed_tokens for n in out.new_reqs})
        for req_id, n in scheduled.items():
            request = self.all_requests[req_id]
            assert request.num_computed_tokens == start[req_id] + n
            if start[req_id] + n < known.get(req_id, request.num_tokens):
                assert out.total_num_scheduled_tokens == cfg.max_num_batched_tokens
        for new in out.new_reqs:
            self.num_hit_tokens += new.num_computed_tokens
            assert new.num_computed_tokens % self.block_size == 0
        for request in scheduler.requests.values():
            self._record_hashes(request)

        runner_output = self.runner.execute(out)
        self._check_runner_view()

        if cfg.async_scheduling:
            runner_output, self.in_flight = self.in_flight, runner_output
        for output in scheduler.update_from_output(runner_output) if runner_output else []:
            self.outputs[output.request_id].extend(output.new_token_ids)
            if output.finished:
                self.finish_reasons[output.request_id] = output.finish_reason
        for req_id, state in self.runner.states.items():  # the runner is ahead by the tokens in flight
            if req_id in scheduler.requests:
                request = scheduler.requests[req_id]
                assert state.token_ids[: request.num_tokens] == request.all_token_ids
                assert len(state.token_ids) == request.num_tokens + request.num_output_placeholders
        self.check()
        return out

    def _record_hashes(self, request: Request) -> None:
        bs = self.block_size
        ids = self.prefix_ids.extend(self._request_prefix_ids.setdefault(request.request_id, []),
                                     self.prefix_key(request), request.all_token_ids)
        for i, block_hash in enumerate(request.block_hashes):
            content = tuple(ids[i * bs : (i + 1) * bs])
            assert self.block_contents.setdefault(block_hash, content) == content, "two block contents share a key"

    def _check_runner_view(self) -> None:
        """Right after a step the runner's block tables are the manager's, and they explain every ref count."""
        kv = self.scheduler.kv_cache_manager
        assert self.runner.states.keys() == kv.req_to_blocks.keys() == {r.request_id for r in self.scheduler.running}
        holders = Counter()
        for req_id, state in self.runner.states.items():
            assert state.block_ids == kv.get_block_ids(req_id)
            holders.update(state.block_ids)
        assert [b.ref_cnt for b in self.pool.blocks] == [holders[i] for i in range(self.pool.num_blocks)]
        # A cached block holds exactly the prefix its key stands for (no stale or unwritten block can be hit).
        for block_hash, block in self.pool.cached_blocks.items():
            assert tuple(self.runner.kv[block.block_id]) == self.block_contents[block_hash], f"{block} holds other KV"

    def check(self) -> None:
        scheduler = self.scheduler
        kv = scheduler.kv_cache_manager
        scheduler.check_invariants()
        self.pool_model.verify(self.pool)
        free = [b.block_id for b in self.pool.free_block_queue]
        held = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)
        assert not set(free) & held.keys(), "a block is both free and held"
        assert len(free) + len(held) == self.pool.num_blocks, "a block leaked"
        assert all(self.pool.blocks[i].ref_cnt == n for i, n in held.items())
        for request in scheduler.running:
            assert len(kv.req_to_blocks[request.request_id]) * self.block_size >= request.num_computed_tokens
        for request in scheduler.waiting:
            assert request.num_computed_tokens == 0
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        queued = [*scheduler.running, *scheduler.waiting]
        assert scheduler.requests.keys() == {r.request_id for r in queued} and len(queued) == len(scheduler.requests)

    def run(self, max_steps: int = 10_000) -> None:
        """Step until every request is done, then once more so the runner hears of the last
        finishes (and, with async scheduling, the last step in flight is read back)."""
        while self.scheduler.num_unfinished:
            assert self.num_steps < max_steps, "no progress"
            self.step()
        self.step()
        assert self.pool.num_free_blocks == self.pool.num_blocks
        for req_id, request in self.all_requests.items():
            assert self.reported_finished[req_id] == request.num_preemptions + 1, f"{req_id} reported wrongly"
            assert request.status.is_finished and request.status.finish_reason == self.finish_reasons[req_id]

    def check_outputs(self) -> None:
        """Requests that ran to the end produced the reference tokens; stopped ones a prefix of them."""
        for req_id, request in self.all_requests.items():
            expected, reason = reference_output(request.prompt_token_ids, request.max_tokens, self.max_model_len,
                                                request.sampling_params.ignore_eos, self.sampler)
            assert self.outputs[req_id] == request.output_token_ids
            if req_id in self.finished_outside:
                assert self.outputs[req_id] == expected[: len(self.outputs[req_id])]
            else:
                assert (self.outputs[req_id], self.finish_reasons[req_id]) == (expected, reason), req_id


def tokens(start: int, n: int) -> list[int]:
    return [(start + i) % (VOCAB - 1) + 1 for i in range(n)]


# ----- deterministic scenarios -----


def test_single_request_runs_to_length():
    h = Harness(num_blocks=8)
    h.add("a", tokens(1, 6), max_tokens=5)
    h.run()
    h.check_outputs()
    assert h.finish_reasons["a"] == "length" and len(h.outputs["a"]) == 5


def test_eos_stops_unless_ignored():
    prompt = next(tokens(s, 3) for s in range(100) if reference_output(tokens(s, 3), 50, 1 << 20, False)[1] == "stop")
    h = Harness(num_blocks=32)
    h.add("stops", prompt, max_tokens=50, ignore_eos=False)
    h.add("ignores", prompt, max_tokens=50, ignore_eos=True)
    h.run()
    h.check_outputs()
    assert h.finish_reasons == {"stops": "stop", "ignores": "length"}
    assert h.outputs["stops"][-1] == EOS and len(h.outputs["ignores"]) == 50


def test_max_model_len_ends_a_request():
    h = Harness(num_blocks=8, max_model_len=10)
    h.add("a", tokens(1, 7), max_tokens=50)
    h.run()
    h.check_outputs()
    assert len(h.outputs["a"]) == 3 and h.finish_reasons["a"] == "length"


def test_long_prompt_is_chunked_to_the_budget():
    h = Harness(num_blocks=16, max_num_batched_tokens=8)
    h.add("a", tokens(1, 20), max_tokens=2)
    chunks = [h.step().num_scheduled_tokens["a"] for _ in range(3)]
    assert chunks == [8, 8, 4]
    assert h.outputs["a"] == [sample(tokens(1, 20))]  # sampled only once the whole prompt is computed
    h.run()
    h.check_outputs()


def test_prefill_chunks_and_decodes_share_a_step_with_running_first():
    h = Harness(num_blocks=32, max_num_batched_tokens=8)
    h.add("a", tokens(1, 20), max_tokens=4)
    assert h.step().num_scheduled_tokens == {"a": 8}
    h.add("b", tokens(5, 10), max_tokens=4)
    assert h.step().num_scheduled_tokens == {"a": 8}  # the running request takes the whole budget
    assert h.step().num_scheduled_tokens == {"a": 4, "b": 4}  # a's last chunk + b's first
    out = h.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 6}  # a decode next to b's prefill chunk
    assert [c.req_id for c in out.cached_reqs] == ["a", "b"] and not out.new_reqs
    h.run()
    h.check_outputs()


def test_max_num_seqs_bounds_the_batch():
    h = Harness(num_blocks=64, max_num_seqs=2)
    for i in range(5):
        h.add(f"r{i}", tokens(i, 5), max_tokens=3 + i)
    out = h.step()
    assert list(out.num_scheduled_tokens) == ["r0", "r1"]
    while "r0" not in h.finish_reasons:
        assert len(h.step().num_scheduled_tokens) == 2
    assert [n.req_id for n in h.step().new_reqs] == ["r2"]  # one slot freed, the next in line joins
    h.run()
    h.check_outputs()


def test_budget_is_shared_in_running_order():
    h = Harness(num_blocks=64, max_num_batched_tokens=10)
    for i in range(4):
        h.add(f"r{i}", tokens(i, 4), max_tokens=6)
    assert h.step().num_scheduled_tokens == {"r0": 4, "r1": 4, "r2": 2}
    assert h.step().num_scheduled_tokens == {"r0": 1, "r1": 1, "r2": 2, "r3": 4}
    h.run()
    h.check_outputs()


def test_prefix_hit_skips_computed_blocks_and_is_reported():
    h = Harness(num_blocks=32)
    h.add("a", tokens(1, 13), max_tokens=5)
    h.step()
    h.add("b", tokens(1, 12) + [7, 7], max_tokens=2)
    out = h.step()
    [new] = out.new_reqs
    assert new.num_computed_tokens == 12 and out.num_scheduled_tokens["b"] == 2
    assert new.block_ids[:3] == h.scheduler.kv_cache_manager.get_block_ids("a")[:3]
    h.run()
    h.check_outputs()
    assert h.all_requests["b"].num_cached_tokens == 12 and h.num_hit_tokens == 12


def test_cache_salt_blocks_hits_across_tenants():
    h = Harness(num_blocks=32)
    h.add("a", tokens(1, 13), max_tokens=2, cache_salt="alice")
    h.step()
    h.add("b", tokens(1, 13), max_tokens=2, cache_salt="bob")
    h.add("c", tokens(1, 13), max_tokens=2, cache_salt="alice")
    out = h.step()
    assert {n.req_id: n.num_computed_tokens for n in out.new_reqs} == {"b": 0, "c": 12}
    h.run()
    h.check_outputs()


def test_lora_adapters_never_share_prefix_blocks_with_each_other_or_the_base():
    h = Harness(num_blocks=64, enable_lora=True, max_loras=2)
    h.add("base", tokens(1, 13), max_tokens=2)
    h.add("a", tokens(1, 13), max_tokens=2, lora=1)
    h.step()
    h.add("a again", tokens(1, 13), max_tokens=2, lora=1)
    h.add("b", tokens(1, 13), max_tokens=2, lora=2)
    h.add("base again", tokens(1, 13), max_tokens=2)
    out = h.step()
    assert {n.req_id: n.num_computed_tokens for n in out.new_reqs} == {"a again": 12, "b": 0, "base again": 12}
    h.run()
    h.check_outputs()


def test_max_loras_holds_back_other_adapters_and_lets_later_requests_pass():
    """With one slot, adapter 2's request waits while adapter 1 runs; the base model's and adapter 1's requests
    behind it go first (vLLM's order); it runs once adapter 1's requests are done."""
    h = Harness(num_blocks=64, enable_lora=True, max_loras=1)
    h.add("a", tokens(1, 5), max_tokens=4, lora=1)
    h.add("b", tokens(2, 5), max_tokens=4, lora=2)
    h.add("base", tokens(3, 5), max_tokens=4)
    h.add("a2", tokens(4, 5), max_tokens=4, lora=1)
    out = h.step()
    assert [n.req_id for n in out.new_reqs] == ["a", "base", "a2"]
    assert [r.request_id for r in h.scheduler.waiting] == ["b"]
    for _ in range(3):  # adapter 1's requests decode their last three tokens; b still waits
        assert "b" not in h.step().num_scheduled_tokens
    assert h.all_requests["a"].status.is_finished and h.all_requests["a2"].status.is_finished
    assert "b" in h.step().num_scheduled_tokens  # the slot is free: b runs at once
    h.run()
    h.check_outputs()


def test_recompute_after_preemption_gives_the_same_tokens_as_a_large_pool():
    workload = [(f"r{i}", tokens(3 * i, 5 + i), 12 + i % 4) for i in range(6)]
    outputs, preemptions = [], []
    for num_blocks in (256, 6):
        for async_scheduling in (False, True):
            h = Harness(num_blocks=num_blocks, max_model_len=24, max_num_batched_tokens=16,
                        async_scheduling=async_scheduling)
            for req_id, prompt, max_tokens in workload:
                h.add(req_id, prompt, max_tokens)
            h.run()
            h.check_outputs()
            outputs.append(h.outputs)
            preemptions.append(h.scheduler.num_preemptions)
    assert preemptions[:2] == [0, 0] and min(preemptions[2:]) > 0
    assert all(o == outputs[0] for o in outputs)


def test_async_plans_the_next_token_before_it_is_known():
    h = Harness(num_blocks=8, async_scheduling=True)
    a = h.add("a", tokens(1, 4), max_tokens=3)
    assert h.step().num_scheduled_tokens == {"a": 4}
    assert h.outputs["a"] == [] and a.num_output_placeholders == 1  # step 1's token is not read back yet
    assert h.step().num_scheduled_tokens == {"a": 1}  # position 4 holds that token; the runner feeds it
    assert len(h.outputs["a"]) == 1 and a.num_output_placeholders == 1
    assert h.step().num_scheduled_tokens == {"a": 1}
    assert h.step().num_scheduled_tokens == {}  # the last token is in flight: nothing left to compute
    assert h.finish_reasons == {"a": "length"}
    h.run()
    h.check_outputs()


def test_async_stop_on_eos_drops_the_token_already_in_flight():
    lengths = {s: len(reference_output(tokens(s, 3), 50, 1 << 20, False)[0]) for s in range(100)}
    prompt = tokens(next(s for s, n in lengths.items() if 2 <= n < 50), 3)  # stops on EOS after a few tokens
    h = Harness(num_blocks=32, async_scheduling=True)
    h.add("a", prompt, max_tokens=50, ignore_eos=False)
    h.run()
    h.check_outputs()  # no token after EOS, though the step after it was already planned
    assert h.finish_reasons == {"a": "stop"} and h.outputs["a"][-1] == EOS
    assert h.num_steps == len(h.outputs["a"]) + 2


def test_fcfs_preempts_the_latest_request_and_requeues_it_first():
    h = Harness(num_blocks=4, max_num_batched_tokens=64)
    h.add("a", tokens(1, 4), max_tokens=8)
    h.add("b", tokens(9, 4), max_tokens=8)
    h.step()  # a and b each fill one block and sample
    h.add("c", tokens(3, 4), max_tokens=2)
    h.step()  # a and b grow into second blocks; c waits for lack of blocks
    out = h.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    while not h.scheduler.num_preemptions:
        out = h.step()
    assert out.finished_req_ids == {"b"} and list(out.num_scheduled_tokens) == ["a"]
    b = h.all_requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(h.scheduler.waiting)[:2] == [b, h.all_requests["c"]]  # back at the front
    token_ids = list(b.all_token_ids)
    out = h.step()
    while not out.new_reqs:
        out = h.step()
    new = out.new_reqs[0]
    assert new.req_id == "b" and new.all_token_ids == token_ids and len(token_ids) > 4  # outputs kept
    h.run()
    h.check_outputs()


def test_priority_policy_preempts_the_lowest_priority_request():
    """Running order n, low, z; n needs a block. FCFS would take z (the latest);
    the priority policy takes `low`, which comes after n so was not scheduled yet."""
    for policy, victim in (("fcfs", "z"), ("priority", "low")):
        h = Harness(num_blocks=3, block_size=4, scheduling_policy=policy)
        h.add("n", [1, 2], max_tokens=6, priority=0)
        h.step()  # n: block 0
        h.add("low", [4], max_tokens=6, priority=5)
        h.step()  # low: block 1
        h.add("z", [5], max_tokens=6, priority=1)
        h.step()  # z: block 2, the pool is full
        assert h.scheduler.num_preemptions == 0 and h.pool.num_free_blocks == 0
        out = h.step()  # n reaches position 4 and needs a second block
        assert h.scheduler.num_preemptions == 1 and out.finished_req_ids == {victim}
        assert h.all_requests[victim].status == RequestStatus.PREEMPTED
        h.run()
        h.check_outputs()


def test_priority_preemption_of_a_request_already_scheduled_this_step():
    """Running order a (low priority), b (high). a is scheduled, then b needs a block
    and the victim is a: a must leave the step's batch, not stay scheduled while the
    runner is told to drop it (the real runner raises KeyError) and while b gets its block."""
    h = Harness(num_blocks=4, block_size=2, scheduling_policy="priority")
    h.add("a", [1, 2, 3], max_tokens=5, priority=1)
    h.step()
    h.add("b", [4, 5], max_tokens=5, priority=0)
    h.step()
    h.step()


def test_abort_frees_blocks_and_is_reported_once():
    h = Harness(num_blocks=16)
    h.add("run", tokens(1, 9), max_tokens=20)
    h.add("wait", tokens(2, 9), max_tokens=20)
    h.add("keep", tokens(3, 5), max_tokens=20)
    h.step()
    held = len(h.scheduler.kv_cache_manager.req_to_blocks["run"])
    free_before = h.pool.num_free_blocks
    assert [r.request_id for r in h.finish(["run", "nope"])] == ["run"]
    assert h.pool.num_free_blocks == free_before + held
    assert h.finish(["run"]) == []  # a second abort is a no-op
    assert h.step().finished_req_ids == {"run"}
    assert h.step().finished_req_ids == set()
    h.finish(["wait"], RequestStatus.FINISHED_STOPPED)
    assert h.step().finished_req_ids == {"wait"}
    h.run()
    h.check_outputs()
    assert h.finish_reasons == {"run": "abort", "wait": "stop", "keep": "length"}


def test_abort_of_a_waiting_request_never_scheduled():
    h = Harness(num_blocks=4, max_num_seqs=1)
    h.add("a", tokens(1, 4), max_tokens=3)
    h.add("b", tokens(2, 4), max_tokens=3)
    h.step()
    h.finish(["b"])
    assert "b" not in h.scheduler.requests and len(h.scheduler.waiting) == 0
    h.run()
    assert h.outputs["b"] == []


def test_finished_request_is_reported_once_and_freed():
    h = Harness(num_blocks=8)
    h.add("a", tokens(1, 4), max_tokens=1)
    out = h.step()
    assert h.finish_reasons == {"a": "length"} and out.finished_req_ids == set()
    assert h.pool.num_free_blocks == 8
    assert h.step().finished_req_ids == {"a"}
    assert h.step().finished_req_ids == set()


def test_harness_catches_a_wrong_prefix_hit():
    """The shadow KV check is not vacuous: poison one cached block and the hit is caught."""
    h = Harness(num_blocks=8)
    h.add("a", tokens(1, 9), max_tokens=1)
    h.run()
    h.runner.kv[h.pool.get_cached_block(h.all_requests["a"].block_hashes[0]).block_id][0] = -1
    h.add("b", tokens(1, 9), max_tokens=1)
    with pytest.raises(AssertionError, match="reads someone else's KV"):
        h.step()


# ----- property tests -----

SALTS = (None, "x", "y")


@st.composite
def workloads(draw, policy: str):
    """Small pools and budgets (preemption and chunking are the norm), prompts cut
    from a few shared prefixes (prefix hits are common), and add / step / abort /
    stop in random order; requests not added by the ops are added before draining."""
    block_size = draw(st.integers(2, 8))
    num_blocks = draw(st.integers(2, 10))
    # Speculative decoding (synchronous scheduling only) in a third of the runs, its drafts mostly kept under the
    # copying sampler and mostly rejected under the mixing one.
    spec = draw(st.sampled_from([None, None, (1, 1, 1), (2, 3, 1), (4, 2, 2), (3, 2, 1, 2)]))
    lora = draw(st.booleans())  # LoRA adapters 1-3 (0: the base model), at most max_loras of them running
    config = dict(
        enable_lora=lora,
        max_loras=draw(st.integers(1, 2)),
        block_size=block_size,
        max_num_batched_tokens=draw(st.integers(1, 24)),
        max_num_seqs=draw(st.integers(1, 4)),
        enable_prefix_caching=draw(st.sampled_from([True, True, True, False])),
        async_scheduling=spec is None and draw(st.booleans()),
        scheduling_policy=policy,
        sampler=draw(st.sampled_from(list(SAMPLERS))),
        speculative_config=None if spec is None else dict(zip(
            ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"), spec)),
    )
    max_model_len = num_blocks * block_size  # every request fits the pool alone
    num_prefixes = draw(st.integers(1, 3))
    request = st.tuples(
        st.integers(0, num_prefixes - 1),  # shared prefix
        st.integers(0, max_model_len - 1),  # how much of it
        st.integers(0, 2 * block_size),  # private suffix length
        st.integers(1, max_model_len),  # max_tokens
        st.sampled_from(SALTS),
        st.integers(0, 2),  # priority
        st.booleans(),  # ignore_eos
        st.sampled_from([0, 0, 1, 2, 3] if lora else [0]),  # adapter
    )
    requests = draw(st.lists(request, min_size=1, max_size=8))
    later_is_urgent = draw(st.booleans())  # priority order opposite to arrival: preemptions hit early arrivals
    ops = draw(st.lists(st.tuples(st.sampled_from(["add", "add", "step", "step", "step", "abort", "stop"]),
                                  st.integers(0, 7)), max_size=50))
    return num_blocks, max_model_len, config, num_prefixes, requests, later_is_urgent, ops


def replay(num_blocks, max_model_len, config, num_prefixes, requests, later_is_urgent, ops) -> Harness:
    h = Harness(num_blocks=num_blocks, max_model_len=max_model_len, **config)
    prefixes = [tokens(7 * i, max_model_len) for i in range(num_prefixes)]
    pending = list(requests)

    def add() -> None:
        which, prefix_len, suffix_len, max_tokens, salt, priority, ignore_eos, lora = pending.pop(0)
        n = len(h.all_requests)
        prompt = (prefixes[which][:prefix_len] + tokens(11 * n + 5, suffix_len))[: max_model_len - 1] or [1]
        h.add(f"r{n}", prompt, min(max_tokens, max_model_len - len(prompt)),
              priority=priority - 3 * n * later_is_urgent, cache_salt=salt, ignore_eos=ignore_eos, lora=lora)

    for op, index in ops:
        if op == "add" and pending:
            add()
        elif op == "step":
            h.step()
        elif op in ("abort", "stop") and h.scheduler.requests:
            live = sorted(h.scheduler.requests)
            status = RequestStatus.FINISHED_ABORTED if op == "abort" else RequestStatus.FINISHED_STOPPED
            h.finish([live[index % len(live)]], status)
    while pending:
        add()
    h.run()
    h.check_outputs()
    return h


@settings(max_examples=500, deadline=None)
@given(workloads("fcfs"))
def test_random_workloads_fcfs(workload):
    replay(*workload)


@settings(max_examples=600, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate])
@given(workloads("priority"))
def test_random_workloads_priority(workload):
    replay(*workload)


# ----- speculative decoding -----

SPEC = {"num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_spec_decode_kept_drafts_save_steps_and_change_no_token():
    """Under the copying sampler n-gram drafts are right: the same tokens in fewer steps, every one of them the
    one-by-one reference, and the counts say how many drafts were checked and kept."""
    runs = {}
    for spec in (None, SPEC):
        h = Harness(num_blocks=64, sampler="copy", speculative_config=spec)
        h.add("a", tokens(1, 7), max_tokens=30)
        h.add("b", tokens(5, 9), max_tokens=17)
        h.run()
        h.check_outputs()
        runs[spec is None] = h
    plain, spec = runs[True], runs[False]
    assert spec.outputs == plain.outputs
    stats = spec.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0.8 * stats.num_draft_tokens > 0
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens and len(stats.accepted_per_pos) == 3
    assert stats.accepted_per_pos == sorted(stats.accepted_per_pos, reverse=True)  # a kept draft's earlier ones were
    assert spec.num_steps < plain.num_steps / 2
    assert plain.scheduler.spec_stats.num_drafts == 0


def test_spec_decode_rejected_drafts_are_recomputed():
    """Under the mixing sampler most drafts are wrong: their KV slots are rewritten before anyone reads them (the
    shadow cache would catch a stale read) and the output is still the reference."""
    h = Harness(num_blocks=64, speculative_config=SPEC)
    for i in range(4):
        h.add(f"r{i}", tokens(3 * i, 5) * 3, max_tokens=25)
    h.run()
    h.check_outputs()
    stats = h.scheduler.spec_stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens


def test_spec_decode_drafts_fit_max_tokens_max_model_len_and_the_budget():
    h = Harness(num_blocks=64, max_model_len=40, sampler="copy", speculative_config=SPEC,
                max_num_batched_tokens=3)
    h.add("a", tokens(1, 6), max_tokens=9)  # ends by max_tokens
    h.add("b", tokens(2, 30), max_tokens=50)  # ends by max_model_len
    while h.scheduler.num_unfinished:
        out = h.step()
        assert out.total_num_scheduled_tokens <= 3  # drafts that do not fit the budget wait
    h.step()
    h.check_outputs()
    assert len(h.outputs["a"]) == 9 and len(h.all_requests["b"].all_token_ids) == 40


def test_spec_decode_under_preemption_and_prefix_hits():
    """A tiny pool: requests with drafts are preempted and recomputed, and share cached prefixes."""
    h = Harness(num_blocks=9, block_size=2, sampler="copy", speculative_config=SPEC, max_num_batched_tokens=8)
    for i in range(4):
        h.add(f"r{i}", tokens(1, 4) + tokens(i, 2), max_tokens=6)
    h.run()
    h.check_outputs()
    assert h.scheduler.num_preemptions > 0 and h.scheduler.spec_stats.num_accepted_tokens > 0


def test_spec_decode_pauses_above_disable_by_batch_size():
    """No drafts while more requests than disable_by_batch_size run or wait; they resume below it."""
    h = Harness(num_blocks=64, sampler="copy", speculative_config=dict(SPEC, disable_by_batch_size=1))
    h.add("a", tokens(1, 7), max_tokens=6)
    h.add("b", tokens(5, 9), max_tokens=30)
    while len(h.scheduler.requests) > 1:
        assert h.scheduler.spec_stats.num_drafts == 0 and not any(r.spec_token_ids for r in h.scheduler.running)
        h.step()
    h.run()
    h.check_outputs()
    assert h.scheduler.spec_stats.num_accepted_tokens > 0


def test_spec_decode_drops_drafts_rather_than_preempt_for_them():
    """A pool that holds both requests to their ends, but not b's drafts while a still runs: the drafts give way
    and nobody is preempted (a preemption for drafts would recompute a whole request), and the output is the
    reference."""
    h = Harness(num_blocks=4, block_size=4, sampler="copy", speculative_config=dict(SPEC, num_speculative_tokens=2))
    h.add("a", tokens(1, 3), max_tokens=5)  # 8 tokens: 2 blocks
    h.add("b", tokens(2, 3), max_tokens=10)  # 13 tokens: 4 blocks, 3 of them while a runs
    h.run()
    h.check_outputs()
    assert h.scheduler.num_preemptions == 0 and h.scheduler.spec_stats.num_accepted_tokens > 0
