"""A tensor-parallel worker: ranks 1..N-1. It runs only a model runner on its
shard of the model and follows rank 0 step by step; the scheduler, tokenizer
and sampling stay on rank 0.

On one host the engine spawns the workers itself (`spawned_worker`). For
several hosts start every non-zero rank with the standard torch.distributed
environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK):

    python -m nanoinfer.distributed.worker

It learns the engine arguments from rank 0; see docs/tensor_parallel.md.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

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
from nanoinfer.scheduler.output import SchedulerOutput

if TYPE_CHECKING:
    from nanoinfer.config import EngineConfig
    from nanoinfer.model_runner.model_runner import ModelRunner

logger = logging.getLogger("nanoinfer")

LOCAL_HOST = "127.0.0.1"


def ready_key(rank: int) -> str:
    """Store key a spawned worker sets once it runs, so rank 0 can tell "starting" from "dead"."""
    return f"nanoinfer/worker_ready/{rank}"


@dataclass
class StepMessage:
    """One engine step, rank 0 -> workers: the scheduler's delta, and the sampled tokens rank 0 has
    read back since the last message, with their positions (workers do not sample but keep the same
    per-request token lists; the newest tokens reach them on the device, see ModelRunner)."""

    scheduler_output: SchedulerOutput
    sampled_req_ids: list[str]
    sampled_positions: list[int]
    sampled_token_ids: list[list[int]]


def build_worker_runner(config: EngineConfig) -> ModelRunner:
    """This rank's model runner, built as EngineCore builds rank 0's, with the KV cache size every
    rank agrees on."""
    from nanoinfer.engine.core import resolve_device_and_dtype
    from nanoinfer.loader.resolve import resolve_model
    from nanoinfer.model_runner.model_runner import start_model_runner

    if config.device == "cpu":
        split_cpu_threads(config.tensor_parallel_size)
    source = resolve_model(config)
    device, dtype = resolve_device_and_dtype(config, source.hf_config)
    return start_model_runner(config, source, device, dtype, tp_min)


def run_worker(rank: int, world_size: int, local_rank: int, store: dist.Store | None = None) -> None:
    """Join the group, then execute rank 0's steps until it sends None (engine closed)."""
    init_tensor_parallel(rank, world_size, local_rank, store)
    try:
        channel = BroadcastChannel(control_group())
        runner = build_worker_runner(channel.recv())
        logger.info("tensor-parallel worker rank %d/%d ready", rank, world_size)
        while (message := channel.recv()) is not None:
            runner.add_sampled_tokens(message.sampled_req_ids, message.sampled_positions, message.sampled_token_ids)
            runner.execute_model(message.scheduler_output)
        wait_for_device()  # rank 0 stopped cleanly: finish our half of every collective before leaving
        runner.release_cuda_graphs()
    finally:
        destroy_tensor_parallel()


def spawned_worker(rank: int, world_size: int, store_port: int) -> None:
    """Entry point of a worker the engine spawned on its own host (GPU `rank` when on GPU)."""
    store = dist.TCPStore(LOCAL_HOST, store_port, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    store.set(ready_key(rank), "1")
    run_worker(rank, world_size, rank, store)


def main() -> int:
    """`python -m nanoinfer.distributed.worker`: a non-zero rank of a launch across hosts."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if v not in os.environ]
    if missing:
        print(f"nanoinfer worker: error: set {', '.join(missing)} (the torch.distributed env rendezvous)", file=sys.stderr)
        return 2
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not 0 < rank < world_size:
        print(f"nanoinfer worker: error: RANK={rank} must be in 1..{world_size - 1}; rank 0 is the engine itself "
              f"(`nanoinfer serve --tensor-parallel-size {world_size}` with RANK=0)", file=sys.stderr)
        return 2
    local_rank = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
    try:
        run_worker(rank, world_size, local_rank)
    except RuntimeError as e:  # rank 0 closed or died: its connection drops
        print(f"nanoinfer worker rank {rank}: stopped: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
