"""One token budget per step, running requests first, then waiting ones.

Every request just needs `num_tokens - num_computed_tokens` tokens computed: a
fresh prompt needs many (a prefill, chunked when it does not fit the budget),
a generating request needs one. All of them share one forward pass. Blocks are
allocated lazily for exactly the tokens scheduled; when the pool runs dry the
lowest-priority (FCFS: latest) running request is preempted by recompute.
With LoRA adapters, the running requests use at most `max_loras` adapters (the
runner's slots): a waiting request of another adapter waits, and the ones
behind it go first.

With speculative decoding a generating request also carries draft tokens
(`spec_token_ids`, proposed from its own tokens after each step): they are
scheduled as more tokens to compute (when the pool is short they give way
before anyone is preempted), and the ones the runner did not keep are taken
back out of `num_computed_tokens`, so their KV slots are written again.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import deque

from nanoinfer.config import EngineConfig
from nanoinfer.kv_cache.manager import KVCacheManager
from nanoinfer.outputs import EngineCoreOutput, ModelRunnerOutput
from nanoinfer.request import Request, RequestStatus
from nanoinfer.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from nanoinfer.spec_decode.ngram import NgramProposer

logger = logging.getLogger("nanoinfer")


class WaitingQueue:
    """FCFS deque, or a heap on (priority, arrival) under the priority policy."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()

    def push(self, request: Request, front: bool = False) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._tiebreak), request))
        elif front:
            self._fifo.appendleft(request)
        else:
            self._fifo.append(request)

    def peek(self) -> Request:
        return self._heap[0][3] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, request: Request) -> None:
        if self.policy == "priority":
            self._heap = [e for e in self._heap if e[3] is not request]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(request)

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)

    def __iter__(self):
        return (e[3] for e in self._heap) if self.policy == "priority" else iter(self._fifo)


class SpecDecodeStats:
    """Speculative decoding's counts since start (exported as vLLM's spec_decode metrics)."""

    def __init__(self) -> None:
        self.num_drafts = 0  # steps of a request that checked drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []  # [i]: drafts kept at position i of their step (0: the first)

    def add(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        self.accepted_per_pos += [0] * (num_accepted_tokens - len(self.accepted_per_pos))
        for position in range(num_accepted_tokens):
            self.accepted_per_pos[position] += 1


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self._failed: list[EngineCoreOutput] = []  # requests ended before their admission, not yet reported
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # to tell the runner in the next step
        self.num_preemptions = 0
        # Speculative decoding (needs synchronous scheduling: drafts are proposed from the newest tokens).
        self.proposer = NgramProposer(config.speculative) if config.speculative is not None else None
        self.spec_stats = SpecDecodeStats()

    # ----- requests in and out -----

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Abort or stop requests from outside (client gone, stop string); frees their blocks."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)
            finished.append(request)
        return finished

    def _fail_unadmitted(self, request: Request) -> None:
        """End a waiting request that cannot run (it holds no blocks): finish_reason "error", reported with the
        next outputs (`take_failed`)."""
        request.status = RequestStatus.FINISHED_ERROR
        self._free_request(request)
        self._failed.append(EngineCoreOutput(request.request_id, [], finish_reason="error"))

    def take_failed(self) -> list[EngineCoreOutput]:
        """The outputs of requests ended before admission since the last call (the engine core reports them)."""
        failed, self._failed = self._failed, []
        return failed

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request, uncache_computed=request.status == RequestStatus.FINISHED_ERROR)
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ----- one step -----

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        kv = self.kv_cache_manager
        preempted_any = False
        if self.config.scheduling_policy == "priority":
            # Most important first, so the victim (the last) is never a request already scheduled this step.
            self.running.sort(key=lambda r: (r.priority, r.arrival_time))

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.num_output_tokens + request.num_output_placeholders >= request.max_tokens:
                index += 1  # its last token is in flight: nothing more to compute
                continue
            num_known = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
            num_new = min(num_known + len(request.spec_token_ids), budget)
            while True:
                new_blocks = kv.allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                if num_new > num_known:  # drafts are optional: drop them before preempting anyone for them
                    num_new = min(num_known, budget)
                    continue
                victim = self.running[-1]  # FCFS: the latest; priority: the least important
                self._preempt(victim)
                preempted_any = True
                if victim is request:
                    break
            if new_blocks is None:  # the request preempted itself: nothing left to run
                break
            if request.spec_token_ids:  # the drafts that fit the budget
                request.spec_token_ids = request.spec_token_ids[: num_new - num_known]
                if request.spec_token_ids:
                    out.scheduled_spec_tokens[request.request_id] = request.spec_token_ids
            out.cached_reqs.append(
                CachedRequestData(request.request_id, [b.block_id for b in new_blocks], request.num_computed_tokens)
            )
            self._count_scheduled(request, num_new, out)
            budget -= num_new
            index += 1

        # Admit waiting requests only when nothing had to be preempted this step.
        not_ready = []  # grammars still compiling (structured outputs), adapters without a slot: they keep their place
        loras = self._running_loras() if self.config.enable_lora else set()  # (no pass over running without LoRA)
        while not preempted_any and len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request.lora_int_id and request.lora_int_id not in loras and len(loras) >= self.config.max_loras:
                not_ready.append(self.waiting.pop())
                continue
            if request.grammar is not None:
                if not request.grammar.done():
                    not_ready.append(self.waiting.pop())
                    continue
                error = request.grammar.exception()
                if error is not None:  # the server parsed its grammar; the compiler refused it
                    logger.warning("request %s fails: %s", request.request_id, error)
                    self._fail_unadmitted(self.waiting.pop())
                    continue
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget)
            new_blocks = kv.allocate_slots(request, num_new, hit_blocks, num_hit)
            if new_blocks is None:
                break
            self.waiting.pop()
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.lora_int_id:
                loras.add(request.lora_int_id)
            out.new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_len=request.num_prompt_tokens,
                    all_token_ids=list(request.all_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=kv.get_block_ids(request.request_id),
                    num_computed_tokens=num_hit,
                    lora_request=request.lora_request,
                )
            )
            self._count_scheduled(request, num_new, out)
            budget -= num_new
        for request in reversed(not_ready):
            self.waiting.push(request, front=True)
        out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        return out

    @staticmethod
    def _count_scheduled(request: Request, num_new: int, out: SchedulerOutput) -> None:
        """Tokens count as computed once scheduled, and a request that reaches its end gets a placeholder for
        the token being sampled, so the next step can be planned (feeding that token straight from the GPU)
        before this one returns. (A request scheduled this step is never preempted later in it: victims come
        from the end of the running list, after it.)"""
        out.num_scheduled_tokens[request.request_id] = num_new
        request.num_computed_tokens += num_new
        num_known_computed = request.num_computed_tokens - len(request.spec_token_ids)
        if num_known_computed == request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += 1

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the blocks, keep the tokens, queue at the front."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # an in-flight token is dropped and recomputed
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.finished_req_ids.add(request.request_id)  # the runner forgets it; it comes back as new
        self.waiting.push(request, front=True)

    def update_from_output(self, output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply token-level stop conditions, free finished requests."""
        results = []
        for req_id, (start, entries) in output.prompt_logprobs.items():  # before the tokens: a chunk may end both
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING and request.prompt_logprobs is not None:
                request.prompt_logprobs[start : start + len(entries)] = entries
        for req_id, vector in output.pooled.items():  # runner="pooling": a prompt computed is a request done
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while its step ran
            request.status = RequestStatus.FINISHED_STOPPED
            results.append(EngineCoreOutput(req_id, [], finish_reason="stop",
                                            num_cached_tokens=max(request.num_cached_tokens, 0), pooled=vector))
            self.running.remove(request)
            self._free_request(request)
        for req_id, token_ids, logprobs in zip(output.req_ids, output.sampled_token_ids, output.logprobs):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while its step ran
            request.num_output_placeholders -= 1
            drafts = request.spec_token_ids
            if drafts:  # the runner kept len(token_ids) - 1 of them; the others' KV slots get rewritten later
                request.spec_token_ids = []
                request.num_computed_tokens -= len(drafts) - (len(token_ids) - 1)
                self.spec_stats.add(len(drafts), len(token_ids) - 1)
            failed = req_id in output.errors
            if failed:
                logger.warning("request %s ends with finish_reason 'error': %s", req_id, output.errors[req_id])
                request.status = RequestStatus.FINISHED_ERROR
                token_ids, logprobs = [], []
            for i, token_id in enumerate(token_ids):  # a stop among them drops the rest
                if request.append_output_token(token_id, self.max_model_len):
                    token_ids, logprobs = token_ids[: i + 1], logprobs[: i + 1]
                    break
            finished = request.status.is_finished
            results.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=token_ids,
                    new_logprobs=logprobs,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    prompt_logprobs=None if failed else request.take_prompt_logprobs(),
                )
            )
            if finished:
                self.running.remove(request)
                self._free_request(request)
            elif self.proposer is not None and request.can_speculate and self._drafting():
                # Every emitted token must fit max_tokens and the context: the drafts, and the one sampled after.
                room = min(request.max_tokens - request.num_output_tokens, self.max_model_len - request.num_tokens) - 1
                request.spec_token_ids = self.proposer.propose(req_id, request.all_token_ids, room)
        return results

    def _running_loras(self) -> set[int]:
        """The ids of the LoRA adapters of running requests (at most max_loras)."""
        return {r.lora_int_id for r in self.running} - {0}

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """The names of the LoRA adapters of running requests, and of waiting ones (the lora_requests_info metric)."""
        return tuple(sorted({r.lora_request.lora_name for r in queue if r.lora_request is not None})
                     for queue in (self.running, self.waiting))

    def _drafting(self) -> bool:
        """Whether drafts are proposed now (speculative_config's disable_by_batch_size)."""
        limit = self.proposer.config.disable_by_batch_size
        return limit is None or len(self.requests) <= limit

    def check_invariants(self) -> None:
        """Debug check after a step: KV bookkeeping consistent and owned only by live requests."""
        self.kv_cache_manager.check_invariants()
        for req_id in self.kv_cache_manager.req_to_blocks:
            assert req_id in self.requests, f"blocks held by unknown request {req_id}"
        for request in self.running:
            assert request.status == RequestStatus.RUNNING
        loras = self._running_loras()
        assert len(loras) <= (self.config.max_loras if self.config.enable_lora else 0), f"running adapters {loras}"
        for request in self.waiting:
            assert request.request_id not in self.kv_cache_manager.req_to_blocks, f"waiting {request.request_id} holds blocks"
