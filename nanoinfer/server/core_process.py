"""The engine-core process: `EngineCore.step()` in a loop behind two ZeroMQ
sockets, so model work never shares an event loop with HTTP.

The loop never waits on the API process: between steps it drains whatever
inputs arrived without blocking, and its outputs go onto an unbounded queue.
It blocks only when it has nothing to run, and exits when told to, when the
API process is gone, or on an error (which it reports first)."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
import sys
import time

import zmq

from nanoinfer.config import EngineConfig
from nanoinfer.engine.input_processor import EngineLimits
from nanoinfer.loader.resolve import ModelSource
from nanoinfer.request import Request, RequestStatus
from nanoinfer.server.wire import MessageType, decode_request, encode_outputs, pack, unpack

logger = logging.getLogger("nanoinfer")

_IDLE_POLL_MS = 1000  # how often an idle core checks that its parent is alive


class EngineCoreProc:
    def __init__(self, input_addr: str, output_addr: str, parent_pid: int) -> None:
        """`parent_pid`: the API process's, given by it (not read here: it may be gone already, and this process's
        parent then is another)."""
        self.parent_pid = parent_pid
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(input_addr)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.SNDHWM, 0)  # unbounded: a slow API process never stalls a step
        self.output.connect(output_addr)
        self.core = None
        self.limits: EngineLimits | None = None
        self.unscheduled: dict[str, Request] = {}  # added, not yet scheduled once: for queue times
        self.running = True

    def start(self, config: EngineConfig, source: ModelSource) -> None:
        from nanoinfer.engine.core import EngineCore

        self.core = EngineCore(config, source)
        # This process holds this one engine until it exits, so what the engine built is never garbage: out of
        # the collector's view, its full passes stop walking the KV block metadata (one object per block: ~10^5
        # on a GPU; a pass over 131k took ~35 ms on our CPU, a pause of every stream). Offline engines are not
        # frozen so: a dropped engine's reference cycles must stay collectable (engine/core.py); their calls defer
        # full passes while they run instead (`defer_full_collections`).
        gc.collect()
        gc.freeze()
        self.limits = self.core.limits()
        limits = dataclasses.asdict(self.limits) | {"eos_token_ids": sorted(self.limits.eos_token_ids)}
        self._send(MessageType.READY, limits, self.core.num_blocks)

    def run(self) -> None:
        while self.running:
            got_input = self._handle_inputs(0 if self.core.has_unfinished_requests() else _IDLE_POLL_MS)
            if os.getppid() != self.parent_pid:
                logger.warning("the API server process is gone; the engine core exits")
                return
            if not self.running:
                return
            if self.core.has_unfinished_requests():
                step_start = time.monotonic()
                self._send_outputs(self.core.step(), step_start)
            elif got_input:  # aborts changed the stats (blocks freed) without a step
                self._send_outputs([], time.monotonic())

    def _handle_inputs(self, timeout_ms: int) -> bool:
        if not self.input.poll(timeout_ms):
            return False
        while True:
            try:
                message = unpack(self.input.recv(zmq.NOBLOCK))
            except zmq.Again:
                return True
            kind = message[0]
            if kind == MessageType.ADD:
                request = decode_request(message[1], self.limits.eos_token_ids, self.limits.block_size)
                self.core.add_request(request)
                self.unscheduled[request.request_id] = request
            elif kind == MessageType.ABORT:
                self.core.abort_requests(message[1], RequestStatus(message[2]))
                for request_id in message[1]:
                    self.unscheduled.pop(request_id, None)
            elif kind == MessageType.SHUTDOWN:
                self.running = False
            else:
                raise ValueError(f"unknown message type {kind!r} from the API process")

    def _send_outputs(self, outputs, step_start: float) -> None:
        scheduled = [[rid, step_start - r.arrival_time] for rid, r in self.unscheduled.items()
                     if r.status != RequestStatus.WAITING]
        for request_id, _ in scheduled:
            del self.unscheduled[request_id]
        self._send(MessageType.OUTPUTS, encode_outputs(outputs), scheduled, dataclasses.asdict(self.core.stats()))

    def _send(self, *frame) -> None:
        try:
            self.output.send(pack(*frame), zmq.NOBLOCK)
        except zmq.Again:  # no peer: the API process is gone
            logger.warning("the API server process is not listening; the engine core exits")
            self.running = False

    def send_error(self, message: str) -> None:
        try:
            self.output.send(pack(MessageType.ERROR, message), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        if self.core is not None:
            self.core.close()  # tensor-parallel workers
        self.ctx.destroy(linger=1000)  # long enough to deliver a last error message


def _ignore_signal(signum, frame) -> None:
    """Ctrl-C, and SIGTERM sent to the whole process group or cgroup, are meant for the
    server: the API process drains, then tells the core to exit. (A handler, unlike
    SIG_IGN, is not inherited by processes the core starts.)"""


def _leave_a_cpu_to_the_api_process() -> None:
    """With every core in torch's thread pool, each parallel op of a CPU step waits
    for a thread the API process (HTTP, detokenizing) preempted: on 2 cores that
    made steps 30x slower. An explicit OMP_NUM_THREADS wins."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, torch.get_num_threads() - 1))


def run_engine_core(config: EngineConfig, source: ModelSource, input_addr: str, output_addr: str,
                    parent_pid: int) -> None:
    """Entry point of the spawned process."""
    signal.signal(signal.SIGINT, _ignore_signal)
    signal.signal(signal.SIGTERM, _ignore_signal)
    _leave_a_cpu_to_the_api_process()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [engine core]: %(message)s")
    proc = EngineCoreProc(input_addr, output_addr, parent_pid)
    try:
        try:
            proc.start(config, source)
        except (ValueError, TypeError, FileNotFoundError) as e:  # a bad model or setting: the user's, one line
            proc.send_error(f"{type(e).__name__}: {e}")
            sys.exit(1)
        proc.run()
    except Exception as e:
        logger.exception("the engine core failed")
        proc.send_error(f"{type(e).__name__}: {e}")
        sys.exit(1)
    finally:
        proc.close()
