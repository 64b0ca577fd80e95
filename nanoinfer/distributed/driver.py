"""Rank 0's side of tensor parallelism.

The engine process is rank 0: it owns the scheduler and its own model shard.
The driver starts the other ranks (spawned on this host, or joined through the
env rendezvous when they were launched on several hosts), sends each step's
SchedulerOutput delta to them before running the step itself, and turns a
dead worker into a clear error instead of a hang. Tokens are sampled on rank 0
only; the workers get them on the device at once (a broadcast inside the
step) and as host lists with a later step's message.
"""

from __future__ import annotations

import dataclasses
import multiprocessing.connection
import os
import signal
import time
import weakref
from collections import deque
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing

from nanoinfer.distributed.channel import BroadcastChannel
from nanoinfer.distributed.parallel_state import (
    COLLECTIVE_TIMEOUT,
    control_group,
    destroy_tensor_parallel,
    init_tensor_parallel,
    split_cpu_threads,
    tp_min,
    wait_for_device,
)
from nanoinfer.distributed.worker import LOCAL_HOST, StepMessage, ready_key, spawned_worker
from nanoinfer.scheduler.output import SchedulerOutput

if TYPE_CHECKING:
    from nanoinfer.config import EngineConfig
    from nanoinfer.model_runner.model_runner import ModelRunner
    from nanoinfer.model_runner.output import RunnerFuture

JOIN_TIMEOUT_S = 10.0
# How often rank 0, waiting for a step on the GPU, checks that the workers are alive.
WORKER_CHECK_S = 0.05
# How long a failed collective waits for a worker to finish dying (its sockets close first).
DEATH_GRACE_S = 5.0


_STARTUP_HINT = ("; a worker that dies while starting often means that the script which made the engine lacks an "
                 "`if __name__ == \"__main__\":` guard (the workers are spawned: each imports the script again)")


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process is gone; the engine cannot continue."""


def check_tensor_parallel_size(hf_config: Any, tp_size: int) -> None:
    """Fail before any process starts when the model cannot be split `tp_size` ways: every rank needs
    whole query and KV heads (GQA groups stay on one rank) and an equal slice of the MLP."""
    sizes = {
        "num_attention_heads": hf_config.num_attention_heads,
        "num_key_value_heads": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        "intermediate_size": hf_config.intermediate_size,
    }
    bad = {name: value for name, value in sizes.items() if value % tp_size}
    if bad:
        valid = [s for s in range(1, min(sizes.values()) + 1) if all(v % s == 0 for v in sizes.values())]
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not divide this model's "
            f"{', '.join(f'{name}={value}' for name, value in bad.items())}; "
            f"valid tensor-parallel sizes: {valid}"
        )


def _describe_exit(exitcode: int) -> str:
    return f"was killed by {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exited with code {exitcode}"


class _Workers:
    """What stopping the workers needs, apart from the driver, so that a weakref finalizer can hold it:
    the workers then also stop when the engine is garbage collected or the interpreter exits."""

    def __init__(self) -> None:
        self.processes: list[BaseProcess] = []  # spawned workers, rank i + 1; empty for a launch across hosts
        self.channel: BroadcastChannel | None = None
        self.serving = False  # the workers are in their step loop, so they can be told to stop
        self.cpu_threads: int | None = None  # rank 0's torch thread count before a CPU run split the cores
        self.release_cuda_graphs: Callable[[], None] | None = None  # rank 0's runner's, once attached

    def shutdown(self) -> None:
        if self.serving:
            self.serving = False
            if not any(p.exitcode is not None for p in self.processes):
                wait_for_device()  # the workers run every step sent, so this ends; then they may leave
            try:
                self.channel.send(None)
            except RuntimeError:
                pass  # a worker is gone; the rest are stopped below
            for process in self.processes:
                process.join(JOIN_TIMEOUT_S)
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(JOIN_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
        if self.release_cuda_graphs is not None:
            self.release_cuda_graphs()
        destroy_tensor_parallel()
        if self.cpu_threads is not None:
            torch.set_num_threads(self.cpu_threads)


class TensorParallelDriver:
    def __init__(self, config: EngineConfig, hf_config: Any, device: torch.device) -> None:
        """Validate the size, start or join the other ranks and send them the engine arguments
        (with the device resolved, so every rank builds the same model the same way)."""
        world_size = config.tensor_parallel_size
        check_tensor_parallel_size(hf_config, world_size)  # (EngineCore checked that no other engine runs)
        self.workers = _Workers()
        self._finalizer = weakref.finalize(self, self.workers.shutdown)
        if device.type == "cpu":
            self.workers.cpu_threads = split_cpu_threads(world_size)
        self.runner: ModelRunner | None = None
        self.error: BaseException | None = None
        self._unsent: deque[RunnerFuture] = deque()  # launched steps whose tokens the workers lack
        with self._guard():
            if "MASTER_ADDR" in os.environ and "WORLD_SIZE" in os.environ:
                self._join_env_rendezvous(world_size)
            else:
                self._spawn_workers(world_size, device)
            self.workers.channel = BroadcastChannel(control_group())
            self.workers.channel.send(dataclasses.replace(config, device=device.type))

    def _join_env_rendezvous(self, world_size: int) -> None:
        """The other ranks were launched by hand (`python -m nanoinfer.distributed.worker`), maybe on other hosts."""
        env_world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))
        if env_world_size != world_size:
            raise ValueError(f"WORLD_SIZE={env_world_size} in the environment but tensor_parallel_size={world_size}")
        if rank != 0:
            raise ValueError(f"RANK={rank}: the engine is rank 0; start ranks 1..{world_size - 1} with "
                             f"`python -m nanoinfer.distributed.worker`")
        init_tensor_parallel(0, world_size, int(os.environ.get("LOCAL_RANK", "0")))

    def _spawn_workers(self, world_size: int, device: torch.device) -> None:
        """Ranks 1..N-1 on this host (GPU i for rank i), rendezvous through a store on a free local port."""
        if device.type == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} GPUs, "
                             f"{torch.cuda.device_count()} are visible")
        store = dist.TCPStore(LOCAL_HOST, 0, world_size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                              wait_for_workers=False)
        context = torch.multiprocessing.get_context("spawn")
        for rank in range(1, world_size):
            process = context.Process(target=spawned_worker, args=(rank, world_size, store.port),
                                      name=f"nanoinfer-tp-rank{rank}", daemon=True)
            process.start()
            self.workers.processes.append(process)
        # Wait for every worker to come up while watching for one that dies starting (e.g. a script without
        # an `if __name__ == "__main__":` guard, which the spawn start method needs).
        keys = [ready_key(r) for r in range(1, world_size)]
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
        while not store.check(keys):
            self._raise_if_worker_died(hint=_STARTUP_HINT)
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not start within {COLLECTIVE_TIMEOUT}")
            time.sleep(0.05)
        init_tensor_parallel(0, world_size, 0, store)

    def agree_num_blocks(self, num_blocks: int) -> int:
        """Agree on the number of KV blocks with the workers (each sizes its own budget; the smallest wins)."""
        with self._guard():
            return tp_min(num_blocks)

    def attach(self, runner: ModelRunner) -> None:
        """Rank 0's runner is built; from here on the workers follow every step."""
        self.runner = runner
        self.workers.release_cuda_graphs = runner.release_cuda_graphs
        self.workers.serving = True

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerFuture | None:
        """Send the step (and the tokens read back since the last one) to the workers, then launch
        rank 0's part. Nothing waits for the device here, so async scheduling works as on one GPU."""
        with self._guard():
            self.workers.channel.send(StepMessage(scheduler_output, *self._read_back_tokens()))
            future = self.runner.execute_model(scheduler_output)
        if future is not None:
            # Weakly: a future the caller keeps must not keep the driver, and so the workers, alive.
            wait = weakref.WeakMethod(self._wait_for_step)
            future.wait_for_device = lambda event: (wait() or torch.cuda.Event.synchronize)(event)
            self._unsent.append(future)
        return future

    def _wait_for_step(self, event: torch.cuda.Event) -> None:
        """Wait for a launched step on the GPU, checking the workers every WORKER_CHECK_S: a worker
        that dies mid-step leaves rank 0's GPU spinning in a symmetric-memory all-reduce, which no
        NCCL timeout ends, so blocking in CUDA would hang the engine."""
        with self._guard():
            checked = time.monotonic()
            while not event.query():
                if time.monotonic() - checked > WORKER_CHECK_S:
                    self._raise_if_worker_died()
                    checked = time.monotonic()
                time.sleep(0)

    def _read_back_tokens(self) -> tuple[list[str], list[int], list[list[int]]]:
        """(req_ids, positions, each request's new token ids) of the launched steps whose results the engine
        has read, oldest first; it reads them in launch order."""
        req_ids: list[str] = []
        positions: list[int] = []
        token_ids: list[list[int]] = []
        while self._unsent and self._unsent[0].done():
            future = self._unsent.popleft()
            output = future.result()
            req_ids += output.req_ids
            positions += future.positions
            token_ids += output.sampled_token_ids
        return req_ids, positions, token_ids

    def close(self) -> None:
        """Stop the workers and leave the process group; idempotent."""
        self._finalizer()

    def _dead_workers(self, wait_s: float = 0.0) -> list[str]:
        processes = self.workers.processes
        if wait_s and processes:
            ready = set(multiprocessing.connection.wait([p.sentinel for p in processes], timeout=wait_s))
            for process in processes:
                if process.sentinel in ready:
                    process.join()  # its pipe closes a moment before it can be reaped
        return [f"tensor-parallel worker rank {rank} (pid {p.pid}) {_describe_exit(p.exitcode)}"
                for rank, p in enumerate(processes, 1) if p.exitcode is not None]

    def _raise_if_worker_died(self, wait_s: float = 0.0, hint: str = "") -> None:
        if dead := self._dead_workers(wait_s):
            raise WorkerDiedError("; ".join(dead) + " (its error, if any, is in the log above); "
                                  "the tensor-parallel engine cannot continue" + hint)

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Around everything that talks to the workers. After a failure the ranks are out of step for good:
        the workers are stopped, a dead one is named, and every later call fails at once."""
        if self.error is not None:
            raise RuntimeError(f"the tensor-parallel engine stopped after an earlier error: {self.error}")
        try:
            self._raise_if_worker_died()
            yield
        except BaseException as e:
            self.error, self.workers.serving = e, False  # out of step: stop the workers, do not message them
            try:
                if not isinstance(e, WorkerDiedError):
                    # A collective failing on a dropped connection usually means a worker just died.
                    self._raise_if_worker_died(DEATH_GRACE_S if isinstance(e, RuntimeError) else 0.0)
            except WorkerDiedError as died:
                self.error = died
                raise died from e
            finally:
                self.close()
            raise
