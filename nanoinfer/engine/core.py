"""The engine core: scheduler + model runner, one `step()` at a time.

It speaks token ids only; tokenization, detokenization and stop strings live
in the front end (`LLMEngine`), so the core can run in its own process."""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import gc
import logging
import os
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from nanoinfer.config import EngineConfig
from nanoinfer.engine.input_processor import EngineLimits
from nanoinfer.layers.fp8 import check_fp8_device, resolve_quantization
from nanoinfer.loader.resolve import ModelSource, resolve_model
from nanoinfer.outputs import EngineCoreOutput
from nanoinfer.request import Request, RequestStatus
from nanoinfer.scheduler.scheduler import Scheduler

logger = logging.getLogger("nanoinfer")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device_and_dtype(config: EngineConfig, hf_config) -> tuple[torch.device, torch.dtype]:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was asked for but no CUDA GPU is available")
    device = torch.device("cuda" if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()) else "cpu")
    if config.dtype == "auto" and device.type == "cpu":
        return device, torch.float32
    return device, gpu_dtype(config, hf_config)


def gpu_dtype(config: EngineConfig, hf_config) -> torch.dtype:
    """What a model runs in on a GPU: config.dtype, or for "auto" the model's own float16 / bfloat16 (bfloat16 for
    any other)."""
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    model_dtype = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


_heap_frozen = False


def _freeze_startup_heap() -> None:
    """What the process holds before its first engine (torch, transformers: ~4 x 10^5 objects) is
    not garbage: take it out of the collector's view, so that each full collection during a run
    (the requests' token lists trigger them) does not walk it again (~0.1-0.2 s each). Once per
    process: engines themselves stay collectable (a dropped engine, cycles included, must be freed).
    At exit the heap goes back to the collector: frozen objects are never collected, not even by
    the interpreter's last collection, and extension modules that count their live objects at
    shutdown (triton's bindings, which torch imports) would print every one of them as a leak."""
    global _heap_frozen
    if not _heap_frozen:
        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)
        _heap_frozen = True


_deferring = 0
_deferring_lock = threading.Lock()
_saved_thresholds: tuple[int, int, int] = gc.get_threshold()


@contextmanager
def defer_full_collections() -> Iterator[None]:
    """While an offline call runs its requests, the collector makes young passes only. A full pass walks every
    tracked object, and an engine holds one per KV block (73k-146k on an H200): 20-40 ms each, two or three per
    reference-workload run (`throughput.py --step-stats` gc_full_s), each a pause the one step queued ahead on
    the GPU cannot cover. A run leaves no cyclic garbage of its own (tests/test_offline_api.py counts it), so the
    deferred passes lose nothing; the thresholds come back when the last overlapping call ends."""
    global _deferring, _saved_thresholds
    with _deferring_lock:
        if _deferring == 0:
            _saved_thresholds = gc.get_threshold()
            gc.set_threshold(_saved_thresholds[0], _saved_thresholds[1], 2**31 - 1)
        _deferring += 1
    try:
        yield
    finally:
        with _deferring_lock:
            _deferring -= 1
            if _deferring == 0:
                gc.set_threshold(*_saved_thresholds)


class EngineDeadError(RuntimeError):
    """The engine cannot go on (a step failed, it was closed, or its core process is gone): create a new one."""


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    running_lora_adapters: list[str] = field(default_factory=list)  # enable_lora: adapter names, running requests'
    waiting_lora_adapters: list[str] = field(default_factory=list)  # ... and waiting ones'


# This process's engines. torch.distributed keeps one process group per process, and every model of the process
# reads it (its collectives, its rank): a tensor-parallel engine must live alone (`_check_alone`).
_engines: weakref.WeakSet[EngineCore] = weakref.WeakSet()


def _check_alone(tensor_parallel: bool) -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise RuntimeError("a tensor-parallel engine runs in this process (or torch.distributed was initialised): "
                           "close it first (LLM.close()); its process group would be every engine's")
    if tensor_parallel:
        gc.collect()  # engines dropped but not collected yet
        if any(engine.error is None for engine in _engines):
            raise RuntimeError("another engine runs in this process: close it first (LLM.close()); a tensor-"
                               "parallel engine's process group would be every engine's")


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None) -> None:
        from nanoinfer.model_runner.model_runner import start_model_runner

        _check_alone(config.tensor_parallel_size > 1)
        _freeze_startup_heap()
        self.config = config
        self.source = source or resolve_model(config)
        hf_config = self.source.hf_config
        self.max_model_len = self.source.max_model_len
        self.device, self.dtype = resolve_device_and_dtype(config, hf_config)
        if resolve_quantization(config.quantization, hf_config) == "fp8":  # (what it cannot run: before workers)
            check_fp8_device(self.device)
        # TP: this process is rank 0; the driver starts the workers, which build their runners
        # with the same start_model_runner.
        self.tp_driver = None
        if config.tensor_parallel_size > 1:
            from nanoinfer.distributed.driver import TensorParallelDriver

            self.tp_driver = TensorParallelDriver(dataclasses.replace(config, **self.source.hub_revisions), hf_config,
                                                  self.device)
            self.runner = start_model_runner(config, self.source, self.device, self.dtype,
                                             self.tp_driver.agree_num_blocks)
            self.tp_driver.attach(self.runner)
        else:
            self.runner = start_model_runner(config, self.source, self.device, self.dtype)
        pooler = self.runner.pooler
        if pooler is not None and pooler.pooling_type != "LAST" and config.enable_prefix_caching:
            # MEAN / CLS pool every prompt token's hidden state, so no prompt may skip its cached prefix: vLLM too
            # caches prefixes for LAST pooling only.
            self.config = config = dataclasses.replace(config, enable_prefix_caching=False)
        self.num_blocks = self.runner.num_blocks
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB, %s on %s)", self.num_blocks,
                    config.block_size, self.num_blocks * config.block_size,
                    self.num_blocks * self.runner.kv_block_bytes / 2**30, self.runner.kv_cache_dtype, self.device)
        if self.num_blocks * config.block_size < self.max_model_len:
            logger.warning("the KV cache holds %d tokens, fewer than max_model_len (%d): no request may pass %d "
                           "tokens, prompt and output together; give the cache more memory, or set max_model_len "
                           "to fit", self.num_blocks * config.block_size, self.max_model_len,
                           self.num_blocks * config.block_size)
        self.scheduler = Scheduler(config, self.num_blocks, self.max_model_len)
        self.debug_checks = os.environ.get("NANOINFER_DEBUG_CHECKS", "0") == "1"
        # Overlap host work with the device: plan step N+1 while step N runs (also with TP:
        # workers get the sampled tokens on the device). Not with speculative decoding: a step's drafts are
        # proposed from the tokens the step before it produced.
        self.async_scheduling = config.async_scheduling and config.speculative is None
        self.in_flight = None
        self.error: str | None = None  # why this core cannot go on
        _engines.add(self)

    def limits(self) -> EngineLimits:
        """What the front end's admission checks need to know about this core."""
        vocab_size = self.source.hf_config.vocab_size
        max_logprobs = vocab_size if self.config.max_logprobs == -1 else min(self.config.max_logprobs, vocab_size)
        return EngineLimits(self.max_model_len, self.max_tokens_per_request, self.config.block_size, vocab_size,
                            set(self.source.eos_token_ids), max_logprobs, self.config.max_num_waiting,
                            self.config.scheduling_policy == "priority")

    @property
    def max_tokens_per_request(self) -> int:
        """Longest a request may get: the model's context and the whole KV cache bound it."""
        return min(self.max_model_len, self.num_blocks * self.config.block_size)

    def add_request(self, request: Request) -> None:
        self._check_alive()
        if request.sampling_params.structured_outputs is not None:  # compiles beside the steps until admitted
            request.grammar = self.runner.grammar_compiler().compile_async(request.sampling_params.structured_outputs)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self.in_flight is not None

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and launch a step. With async scheduling the outputs returned
        are the previous step's: its tokens are read back while this one runs.

        A step that raises (an out-of-memory error, Ctrl-C, a dead worker) leaves the core dead: its bookkeeping
        had run ahead of the device (tokens counted as computed, prompt blocks cached before they were written),
        so no later step could be trusted. Every later call raises EngineDeadError, as vLLM's does."""
        self._check_alive()
        try:
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.is_empty and self.in_flight is None:
                self._wait_for_grammars()
            future = (self.tp_driver or self.runner).execute_model(scheduler_output)
            if self.async_scheduling:
                future, self.in_flight = self.in_flight, future
            outputs = self.scheduler.update_from_output(future.result()) if future is not None else []
            if failed := self.scheduler.take_failed():  # requests that ended before admission
                outputs = failed + outputs
            if self.debug_checks:
                self.scheduler.check_invariants()
        except BaseException as e:
            self.error = f"the engine stopped after a step failed ({type(e).__name__}: {e}); create a new engine"
            raise
        return outputs

    def _wait_for_grammars(self, timeout: float = 0.05) -> None:
        """Nothing to run but requests whose grammar still compiles: wait for one (briefly: the caller may have
        other work, such as the server's incoming messages) instead of stepping in a busy loop."""
        pending = [r.grammar for r in self.scheduler.waiting if r.grammar is not None and not r.grammar.done()]
        if pending:
            concurrent.futures.wait(pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(self.error)

    def close(self) -> None:
        """Stop the tensor-parallel workers (also done when the core is garbage collected or at exit); the
        core takes no more requests."""
        self.error = self.error or "the engine was closed"
        if self.tp_driver is not None:
            self.tp_driver.close()

    def stats(self) -> SchedulerStats:
        kv, spec = self.scheduler.kv_cache_manager, self.scheduler.spec_stats
        return SchedulerStats(len(self.scheduler.running), len(self.scheduler.waiting), kv.usage,
                              kv.prefix_queries, kv.prefix_hits, self.scheduler.num_preemptions,
                              spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                              list(spec.accepted_per_pos),
                              *(self.scheduler.lora_adapters() if self.config.enable_lora else ()))
