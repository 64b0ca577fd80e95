"""The API process's side of the engine core: spawns the core process, admits
requests (validation, tokenization and `n` fan-out in `admit`, which the server
runs off the event loop; the queue bound in `register`) and ships them over
ZeroMQ, and turns the core's output batches into per-request streams
(incremental detokenization, stop strings) on the event loop."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from typing import Iterable

import zmq
import zmq.asyncio

from nanoinfer.config import EngineConfig
from nanoinfer.engine.core import EngineDeadError
from nanoinfer.engine.input_processor import Admitted, EngineLimits, InputProcessor
from nanoinfer.engine.llm_engine import load_model_and_tokenizer
from nanoinfer.engine.output_processor import OutputProcessor
from nanoinfer.lora.adapter import admission_registry
from nanoinfer.lora.request import LoRARequest
from nanoinfer.outputs import RequestOutput
from nanoinfer.pooling_params import PoolingParams
from nanoinfer.request import RequestStatus
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams
from nanoinfer.server.core_process import run_engine_core
from nanoinfer.server.metrics import ServerMetrics
from nanoinfer.server.wire import MessageType, decode_outputs, encode_request, pack, unpack

logger = logging.getLogger("nanoinfer")


class OutputStream:
    """The outputs of one API call's requests (one per prompt): deltas for a streaming
    call, one final output each otherwise. A delta that arrives before the reader took
    the previous one is merged into it, so a slow reader gets one per request, never a
    backlog."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.unfinished = set(request_ids)
        self._pending: dict[str, RequestOutput] = {}
        self._error: Exception | None = None
        self._event = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        pending = self._pending.get(output.request_id)
        if pending is None:
            self._pending[output.request_id] = output
        else:
            pending.add(output)
        if output.finished:
            self.unfinished.discard(output.request_id)
        self._event.set()

    def fail(self, error: Exception) -> None:
        self._error = error
        self.unfinished.clear()
        self._event.set()

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> dict[str, RequestOutput]:
        """The requests that changed since the last call, by request id."""
        while not self._pending:
            if self._error is not None:
                raise self._error
            if not self.unfinished:
                raise StopAsyncIteration
            await self._event.wait()
            self._event.clear()
        pending, self._pending = self._pending, {}
        return pending


class CoreClient:
    def __init__(self, config: EngineConfig, metrics: ServerMetrics, max_output_tokens_per_request: int | None) -> None:
        self.config = config
        self.metrics = metrics
        self.max_output_tokens_per_request = max_output_tokens_per_request
        self.streams: dict[str, OutputStream] = {}  # by request id
        self.waiting: set[str] = set()  # child ids the core has not scheduled yet
        self.dead_reason: str | None = None
        self._core_error: str | None = None
        self._closing = False
        self._tmpdir = tempfile.mkdtemp(prefix="nanoinfer-")
        # Sends are plain non-blocking calls on an unbounded queue: they never wait on the core.
        self._sync_ctx = zmq.Context()
        self._input = self._sync_ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.bind(f"ipc://{self._tmpdir}/input")
        self._ctx = zmq.asyncio.Context()
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(f"ipc://{self._tmpdir}/output")
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._output_task: asyncio.Task | None = None

    # ----- life cycle -----

    async def start(self, loras: Iterable[LoRARequest] = ()) -> None:
        """Resolve the model, check the LoRA adapters served from the start (a bad one fails here, before the core
        loads the model), start the core process and wait until it has loaded it."""
        source, self.tokenizer = load_model_and_tokenizer(self.config)
        self.loras = admission_registry(self.config, source.hf_config)  # the adapters admission checks
        for lora in loras:
            self.loras.check(lora)
        self.model_path = source.model_path
        self.default_sampling = source.default_sampling  # what requests leave unset (generation_config.json)
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
        proc = ctx.Process(target=run_engine_core, name="nanoinfer-engine-core", args=(
            self.config, source, f"ipc://{self._tmpdir}/input", f"ipc://{self._tmpdir}/output", os.getpid()))
        proc.start()
        self._proc = proc  # (once started: `close` joins it)
        while not await self._output.poll(500):
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine core process exited during start-up (exit code {self._proc.exitcode})")
        message = unpack(await self._output.recv())
        if message[0] == MessageType.ERROR:
            self._proc.join(10)
            raise RuntimeError(f"the engine core failed to start: {message[1]}")
        limits, self.num_blocks = message[1], message[2]
        self.limits = EngineLimits(**(limits | {"eos_token_ids": set(limits["eos_token_ids"])}))
        self.pooler = source.pooler
        self.input_processor = InputProcessor(self.tokenizer, self.limits, pooler=self.pooler,
                                              hidden_size=source.hf_config.hidden_size,
                                              loras=self.loras)
        self.output_processor = OutputProcessor(self.tokenizer, self.pooler)
        asyncio.get_running_loop().add_reader(self._proc.sentinel, self._on_core_exit)
        self._output_task = asyncio.create_task(self._output_loop())

    async def shutdown(self, timeout: float = 10.0) -> None:
        """`close`, with the wait for the core's exit on the event loop instead of blocking it."""
        if self._proc is not None:
            asyncio.get_running_loop().remove_reader(self._proc.sentinel)
        self._ask_core_to_exit()
        deadline = time.monotonic() + timeout
        while self._proc is not None and self._proc.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.close(timeout=0)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the core process (asked to, killed after `timeout` s: it ignores SIGTERM), end the streams still
        open with EngineDeadError (nothing will come for them) and release the sockets. Blocks, and needs no
        running event loop, so it also serves a loop that has stopped and interpreter exit. Safe to call again."""
        self._ask_core_to_exit()
        proc = self._proc
        if proc is not None:
            proc.join(timeout)
            if proc.is_alive():
                logger.warning("the engine core did not exit when asked; killing it")
                proc.kill()
                proc.join(5)
        if self.dead_reason is None:
            self.dead_reason = "the engine core was shut down"
            self._fail_streams(EngineDeadError(self.dead_reason))
        if self._output_task is not None and not self._output_task.get_loop().is_closed():
            self._output_task.cancel()
        self._ctx.destroy(linger=0)
        self._sync_ctx.destroy(linger=0)
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _ask_core_to_exit(self) -> None:
        self._closing = True
        if self._proc is not None and self._proc.is_alive():
            self._send(MessageType.SHUTDOWN)

    def _on_core_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._proc.sentinel)
        self._proc.join(1)  # the sentinel fires as the process ends; reaping it may lag a moment
        if not self._closing and self.dead_reason is None:
            self._die(f"the engine core process died (exit code {self._proc.exitcode})"
                      + (f": {self._core_error}" if self._core_error else ""))

    def _die(self, reason: str) -> None:
        """From now on every request fails fast with `reason` (503), instead of hanging."""
        self.dead_reason = reason
        logger.error("%s; requests fail (the server: 503) until the engine is restarted", reason)
        if self._proc.is_alive():
            self._proc.kill()
        self._fail_streams(EngineDeadError(reason))
        if self._output_task is not None:
            self._output_task.cancel()

    def _fail_streams(self, error: EngineDeadError) -> None:
        for stream in set(self.streams.values()):
            stream.fail(error)
        self.streams.clear()
        self.waiting.clear()

    def check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    @property
    def num_unfinished(self) -> int:
        return len(self.streams)

    # ----- requests in -----

    def admit(self, request_id: str, prompts: list[str | list[int]], params: SamplingParams | PoolingParams,
              priority: int = 0, cache_salt: str | None = None, lora_request: LoRARequest | None = None
              ) -> list[Admitted]:
        """Validate and tokenize one API call's prompts (request i is `{request_id}-{i}`): each prompt's text,
        token ids and child requests. Reads the tokenizer and the limits only, so the server runs it in its
        tokenizer thread. Raises ValueError / TypeError for bad input."""
        # Bound the fan-out before any work per prompt or child: each child asks for at least one token.
        if isinstance(params, SamplingParams):
            self.check_output_tokens(params.n * len(prompts) * (params.max_tokens or 1))
        admitted = [self.input_processor.process(f"{request_id}-{i}", prompt, params, priority, cache_salt, lora_request)
                    for i, prompt in enumerate(prompts)]
        if isinstance(params, SamplingParams):
            self.check_output_tokens(sum(child.max_tokens for a in admitted for child in a.children),
                                      params.max_tokens is None)
        return admitted

    def register(self, request_id: str, params: SamplingParams | PoolingParams, admitted: list[Admitted],
                 stream: bool = False) -> OutputStream:
        """Send `admit`'s requests to the core, all or none. A `stream` gets deltas as tokens arrive, otherwise
        one final output per prompt. Raises OverflowError when the waiting queue is full, EngineDeadError when
        the core is gone."""
        self.check_alive()
        children = [child for a in admitted for child in a.children]
        self.limits.check_waiting_room(len(self.waiting), len(children))
        try:  # before anything is registered, so a refused request leaves nothing behind
            frames = [pack(MessageType.ADD, encode_request(child)) for child in children]
        except (OverflowError, ValueError) as e:  # msgpack holds integers of at most 64 bits
            raise ValueError(f"a number in the request is out of range: {e}") from None
        output_kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        outputs = OutputStream([f"{request_id}-{i}" for i in range(len(admitted))])
        for i, a in enumerate(admitted):
            self.output_processor.add_request(outputs.request_ids[i], a.prompt, a.prompt_token_ids, params,
                                              [child.request_id for child in a.children], output_kind)
            self.streams[outputs.request_ids[i]] = outputs
            for child in a.children:
                self.metrics.start_request(child.request_id, child.arrival_time, len(a.prompt_token_ids))
                self.waiting.add(child.request_id)
        for frame in frames:
            self._send_packed(frame)
        return outputs

    def check_output_tokens(self, total: int, default_max_tokens: bool = False) -> None:
        """`total` output tokens for one API call stay within --max-output-tokens-per-request (ValueError beyond)."""
        limit = self.max_output_tokens_per_request
        if limit is not None and total > limit:
            if default_max_tokens:
                raise ValueError(f"max_tokens unset: each completion may run to the end of the context, and n x "
                                 f"prompts of them come to {total} tokens, over this server's limit of {limit} "
                                 f"output tokens per request; set max_tokens")
            raise ValueError(f"max_tokens x n x prompts = {total} tokens exceeds this server's limit of {limit} "
                             f"output tokens per request")

    def abort(self, stream: OutputStream) -> None:
        """Stop the stream's unfinished requests in the core (freeing their blocks)
        and end them with finish_reason "abort". A no-op once all have finished."""
        now = time.monotonic()
        for request_id in list(stream.unfinished):
            child_ids = self.output_processor.child_ids(request_id)
            self._send(MessageType.ABORT, child_ids, int(RequestStatus.FINISHED_ABORTED))
            for child_id in child_ids:
                self.waiting.discard(child_id)
                self.metrics.finish_request(child_id, "abort", now)
            self.streams.pop(request_id, None)
            final = self.output_processor.abort(request_id)
            if final is not None:
                stream.put(final)

    def abort_all(self) -> None:
        for stream in set(self.streams.values()):
            self.abort(stream)

    def _send(self, *frame) -> None:
        self._send_packed(pack(*frame))

    def _send_packed(self, data: bytes) -> None:
        if self.dead_reason is not None or self._input.closed:  # (closed: the server stopped, its core with it)
            return
        try:
            self._input.send(data, zmq.NOBLOCK)
        except zmq.Again:  # no core connected: it died (and its exit is not handled yet)
            self._die("the engine core process is not reachable")

    # ----- outputs back -----

    async def _output_loop(self) -> None:
        while True:
            message = unpack(await self._output.recv())
            if message[0] == MessageType.ERROR:
                self._core_error = message[1]
                logger.error("the engine core failed: %s", message[1])
                continue
            try:
                self._process_outputs(*message[1:])
            except Exception as e:  # a bug here would leave requests hanging: fail loudly instead
                logger.exception("processing engine outputs failed")
                self._die(f"processing engine outputs failed: {type(e).__name__}: {e}")
                return

    def _process_outputs(self, rows: list, scheduled: list, stats: dict) -> None:
        now = time.monotonic()
        for child_id, queue_time in scheduled:
            self.waiting.discard(child_id)
            self.metrics.observe_queue_time(queue_time)
        outputs = decode_outputs(rows)
        request_outputs, stopped = self.output_processor.process_outputs(outputs)
        self.metrics.on_outputs(outputs, now, stopped)
        if stopped:  # stop strings (or a failed detokenization), found here, end the requests in the core
            self._send(MessageType.ABORT, list(stopped), int(RequestStatus.FINISHED_STOPPED))
        for output in request_outputs:
            stream = self.streams.pop(output.request_id, None) if output.finished else self.streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
        self.metrics.on_core_stats(stats, self.num_blocks)
