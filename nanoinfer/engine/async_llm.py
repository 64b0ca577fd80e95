"""vLLM's AsyncLLM: requests as asyncio streams of outputs, over the server's engine client
(nanoinfer/server/core_client.py): the engine core runs in its own process, a request is admitted
(validated, tokenized) on the event loop, and its outputs come back as its output_kind asks."""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import itertools
import uuid
import weakref
from collections.abc import AsyncGenerator, Iterable
from contextlib import aclosing

from nanoinfer.config import EngineConfig
from nanoinfer.engine.core import EngineDeadError
from nanoinfer.engine.llm_engine import checked_tokenizer
from nanoinfer.inputs import PromptType
from nanoinfer.loader.default_model import DEFAULT_MODEL_NAME
from nanoinfer.lora.request import LoRARequest
from nanoinfer.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from nanoinfer.pooling_params import PoolingParams
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams
from nanoinfer.server.core_client import CoreClient, OutputStream
from nanoinfer.server.metrics import ServerMetrics


def _accumulate(so_far: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """The cumulative output once `delta` is added, as a new object: the outputs already yielded stay as they were
    (`add` rebinds the fields of the copies it merges into, never mutates the lists they share)."""
    if so_far is None:
        return delta
    output = dataclasses.replace(so_far, outputs=[dataclasses.replace(c) for c in so_far.outputs])
    output.add(delta)
    return output


_SHUTDOWN_TIMEOUT_S = 30.0  # shutdown() from another thread waits this long for the engine's loop to stop the core


def _runs_here(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _mark_retrieved(task: asyncio.Task) -> None:
    """A failed start-up raises in every later call, not also as asyncio's "exception was never retrieved"."""
    if not task.cancelled():
        task.exception()


class AsyncLLM:
    """vLLM's asyncio engine: `async for out in engine.generate(prompt, params, request_id)`. One event loop serves
    it: the one running when it is created (the engine core starts at once, as a task of that loop), else the loop
    of its first call. Admission (validation, tokenization) runs on that loop: a long prompt holds it for as long
    as the tokenizer takes (2 MB of text: ~1.5 s). `shutdown()` stops the core process; one left running
    is stopped when the AsyncLLM is garbage collected, or at interpreter exit."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._client = CoreClient(config, ServerMetrics(config.model or DEFAULT_MODEL_NAME),
                                  max_output_tokens_per_request=None)
        # At exit this runs before multiprocessing joins its children (atexit runs the last registered first), which
        # would otherwise wait forever for a core that exits only once this process is gone.
        self._finalizer = weakref.finalize(self, self._client.close)
        self._finalizer.atexit = False
        atexit.register(self._finalizer)
        self._requests: dict[str, OutputStream] = {}  # in flight, by the caller's request id
        self._admissions = itertools.count()
        self._started: asyncio.Task | None = None
        self._shut_down = False
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop yet: the first call starts the core on its own
            return
        self._start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineConfig) -> AsyncLLM:
        """vLLM's: `AsyncLLM.from_engine_args(AsyncEngineArgs(model=...))`."""
        return cls(engine_args)

    # ----- life cycle -----

    def _start(self) -> asyncio.Task:
        self._started = asyncio.get_running_loop().create_task(self._client.start(), name="nanoinfer-async-llm-start")
        self._started.add_done_callback(_mark_retrieved)
        return self._started

    async def _ready(self) -> CoreClient:
        """The client, once the core has started (on this loop, at the first call); EngineDeadError if the start
        failed, the core died or the engine was shut down."""
        if not self._shut_down:
            started = self._started or self._start()
            if started.get_loop() is not asyncio.get_running_loop():
                raise RuntimeError("an AsyncLLM serves one event loop (the one it was created in, or else its first "
                                   "call's); create an AsyncLLM in each loop")
            if not started.done():
                await asyncio.wait([started])  # (wait: a caller cancelled here cancels not the start)
        self._check_alive()
        return self._client

    def _dead_reason(self) -> str | None:
        if self._shut_down:
            return "the engine was shut down"
        error = self._start_error()
        if error is not None:
            return f"the engine failed to start: {type(error).__name__}: {error}"
        return self._client.dead_reason

    def _start_error(self) -> BaseException | None:
        started = self._started
        if started is None or not started.done():
            return None
        return asyncio.CancelledError("the start-up was cancelled") if started.cancelled() else started.exception()

    def _check_alive(self) -> None:
        reason = self._dead_reason()
        if reason is not None:
            raise EngineDeadError(reason) from self._start_error()

    @property
    def errored(self) -> bool:
        """vLLM's: the engine cannot serve (its start failed, its core died or it was shut down)."""
        return self._dead_reason() is not None

    @property
    def is_running(self) -> bool:
        return not self.errored

    @property
    def dead_error(self) -> EngineDeadError:
        """vLLM's: the error calls raise once the engine is dead."""
        return EngineDeadError(self._dead_reason() or "the engine is running")

    async def check_health(self) -> None:
        """vLLM's: raises EngineDeadError unless the engine serves."""
        await self._ready()

    def shutdown(self) -> None:
        """vLLM's: stop the engine core process (asked to, killed after 10 s) and release its sockets, blocking
        until it has exited; requests in flight end with EngineDeadError. Safe to call again, in or out of the
        event loop (from another thread: the loop's own thread does the work), also once the loop has stopped."""
        self._shut_down = True
        loop = None if self._started is None else self._started.get_loop()
        if loop is not None and loop.is_running() and not _runs_here(loop):
            # Its loop runs in another thread, whose objects (streams, tasks, sockets) only that thread may touch.
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown_on_loop(), loop).result(_SHUTDOWN_TIMEOUT_S)
            except TimeoutError:  # that loop is stuck: stop the core from here all the same
                self._finalizer()
        else:
            self._stop()
        atexit.unregister(self._finalizer)

    async def _shutdown_on_loop(self) -> None:
        self._stop()

    def _stop(self) -> None:
        """On the engine's loop, or once no loop runs: cancel a start still under way, stop the core."""
        started = self._started
        if started is not None and not started.done() and not started.get_loop().is_closed():
            started.cancel()  # a start not yet run never spawns the core; one under way stops at its next wait
        self._finalizer()  # (a finalizer runs once)

    # ----- requests -----

    def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, *, lora_request: LoRARequest | None = None,
                 priority: int = 0) -> AsyncGenerator[RequestOutput, None]:
        """vLLM's: the request's outputs as `sampling_params.output_kind` asks: CUMULATIVE (the default) everything
        so far in each, DELTA only what is new, FINAL_ONLY one output at the end; each output is a new object.
        `prompt`: any form LLM.generate takes; `sampling_params` None: the model's defaults; `request_id` None: a
        fresh one (the outputs carry it), and one in flight already is a ValueError. Bad input raises as LLM's
        does, when iteration starts. Stopping early (break, close, cancel) aborts the request; `abort(request_id)`
        ends it with a last output, finish_reason "abort"."""
        return self._outputs(prompt, sampling_params, request_id, priority, lora_request)

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams | None = None,
                     request_id: str | None = None, *, lora_request: LoRARequest | None = None,
                     priority: int = 0) -> AsyncGenerator[PoolingRequestOutput, None]:
        """vLLM's: the prompt's embedding as one output, its vector a tensor (an engine with runner="pooling")."""
        params = PoolingParams() if pooling_params is None else pooling_params
        if not isinstance(params, PoolingParams):
            raise TypeError(f"encode() takes PoolingParams, got {type(params).__name__}; generate() takes "
                            f"SamplingParams")
        async with aclosing(self._outputs(prompt, params, request_id, priority, lora_request)) as outputs:
            async for output in outputs:
                yield PoolingRequestOutput.of(output)

    async def _outputs(self, prompt: PromptType, params: SamplingParams | PoolingParams | None,
                       request_id: str | None, priority: int, lora_request: LoRARequest | None
                       ) -> AsyncGenerator[RequestOutput | EmbeddingRequestOutput, None]:
        """One request's outputs under the caller's id. However the reading ends, the request ends in the core
        (a no-op once it finished there): its blocks are freed."""
        await self._ready()
        if params is None:
            params = await self.get_default_sampling_params()
        request_id, stream = self._add(prompt, params, request_id, priority, lora_request)
        cumulative = isinstance(params, SamplingParams) and params.output_kind is RequestOutputKind.CUMULATIVE
        so_far = None
        try:
            async for updates in stream:
                (output,) = updates.values()
                output.request_id = request_id  # (the stream's objects are handed over: no one else holds them)
                if cumulative:
                    so_far = output = _accumulate(so_far, output)
                if output.finished and self._requests.get(request_id) is stream:
                    del self._requests[request_id]  # its id is free again, whether or not the reader goes on
                yield output
        finally:
            self._client.abort(stream)
            if self._requests.get(request_id) is stream:
                del self._requests[request_id]

    def _add(self, prompt: PromptType, params: SamplingParams | PoolingParams, request_id: str | None,
             priority: int, lora_request: LoRARequest | None) -> tuple[str, OutputStream]:
        """Admit the request and send it to the core. In the core it has an id of its own (the caller's plus an
        admission number), so that an id used again after an abort never receives tokens that the earlier
        request's step, in flight, sampled. Streamed unless FINAL_ONLY: CUMULATIVE outputs are built of deltas."""
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if isinstance(params, (SamplingParams, PoolingParams)):
            params = dataclasses.replace(params)  # validated again (a field may have been set after construction)
        engine_id = f"{request_id}@{next(self._admissions)}"
        admitted = self._client.admit(engine_id, [prompt], params, priority, lora_request=lora_request)
        streamed = isinstance(params, SamplingParams) and params.output_kind is not RequestOutputKind.FINAL_ONLY
        self._requests[request_id] = stream = self._client.register(engine_id, params, admitted, streamed)
        return request_id, stream

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """vLLM's: end the requests (ids not in flight are ignored), freeing their blocks; the generator of each
        yields its last output, finish_reason "abort", and ends."""
        client = await self._ready()
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            stream = self._requests.pop(rid, None)
            if stream is not None:
                client.abort(stream)

    async def get_tokenizer(self):
        """vLLM's: the engine's (transformers) tokenizer; ValueError for a model without one."""
        return checked_tokenizer((await self._ready()).tokenizer)

    async def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no SamplingParams: the model's generation_config.json values, as
        LLM.get_default_sampling_params."""
        return SamplingParams(**(await self._ready()).default_sampling)


AsyncLLMEngine = AsyncLLM  # vLLM's older name
AsyncEngineArgs = EngineConfig  # vLLM's: `AsyncLLM.from_engine_args(AsyncEngineArgs(model=...))`
