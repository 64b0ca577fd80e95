"""Tensor-parallel group state. With no process group initialised every helper
acts as a single rank, so the same model code runs with and without TP.

A TP run has two groups over the same ranks: the default group carries the
model's collectives (NCCL for CUDA tensors, gloo for CPU tensors) with a
bounded timeout, so a dead or stuck rank fails a step instead of hanging it;
the control group (gloo, CPU only) carries rank 0's step messages, on which
workers may wait for as long as the engine sits idle.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from nanoinfer.kernels.all_reduce import FusedAllReduce

logger = logging.getLogger("nanoinfer")

COLLECTIVE_TIMEOUT = timedelta(minutes=5)
CONTROL_TIMEOUT = timedelta(days=365)
LEAVE_TIMEOUT_S = 60.0

_control_group: dist.ProcessGroup | None = None
_uses_nccl = False
# The fused all-reduce + add's kernel and buffers (`enable_symmetric_all_reduce`).
_fused_all_reduce: FusedAllReduce | None = None
# Whether this process has set up symmetric memory for a TP group before: torch cannot set it up for a
# second group of the same name (a later engine in the same process; its rendezvous hangs).
_symm_used = False


def tp_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def init_tensor_parallel(rank: int, world_size: int, local_rank: int, store: dist.Store | None = None) -> None:
    """Join the TP group: through `store` (one host, spawned workers) or the standard env:// rendezvous
    (MASTER_ADDR, MASTER_PORT; several hosts). On a GPU host each rank uses GPU `local_rank` and CUDA
    tensors go through NCCL; CPU tensors (and CPU-only runs) go through gloo."""
    global _control_group, _uses_nccl
    backend = "gloo"
    if local_rank < torch.cuda.device_count():
        # NVLink SHARP (multicast) stays off: it is not needed for TP all-reduces and not every machine allows it.
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        torch.cuda.set_device(local_rank)
        backend = "cpu:gloo,cuda:nccl"
    _uses_nccl = backend != "gloo"
    dist.init_process_group(backend, init_method=None if store is not None else "env://", store=store,
                            rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    _control_group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def split_cpu_threads(world_size: int) -> int:
    """Give this rank its share of the host's cores for a CPU run and return the previous thread count.
    Ranks that each use every core spin against one another between the many small collectives
    (about 20x slower on 2 cores)."""
    previous = torch.get_num_threads()
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // local_ranks))
    return previous


def wait_for_device(timeout_s: float = LEAVE_TIMEOUT_S) -> None:
    """Wait until this rank's GPU has run every launched step (a no-op on CPU). Called on a clean
    shutdown before a rank leaves: an abort while a collective is still running on one GPU leaves
    the peer's half of it spinning, and its own abort then hangs. Bounded: a peer that died unseen
    would keep a collective from ever finishing, and leaving then goes on without waiting."""
    if not _uses_nccl:
        return
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + timeout_s
    while not done.query():
        if time.monotonic() > deadline:
            logger.error("this rank's GPU did not finish its launched steps within %.0f s; leaving anyway", timeout_s)
            return
        time.sleep(0.001)


def destroy_tensor_parallel(timeout_s: float = LEAVE_TIMEOUT_S) -> None:
    """Leave the TP groups. On GPUs each rank aborts its NCCL communicators: a clean NCCL shutdown
    finalizes them, which waits for the other ranks, and ranks leave at different times (or one has
    died), so it can hang; an abort is local. gloo-only (CPU) groups are destroyed normally. It runs
    in a thread given `timeout_s`, so that a stuck NCCL call cannot hang the engine's shutdown (the
    group is then left as it is and logged)."""
    global _control_group, _uses_nccl, _fused_all_reduce
    if not dist.is_initialized():
        return
    _fused_all_reduce = None
    leave = threading.Thread(target=_leave_groups, args=(_uses_nccl,), name="nanoinfer-tp-leave", daemon=True)
    try:
        leave.start()
    except RuntimeError:  # at interpreter exit (Python >= 3.12 starts no thread from atexit): leave here
        _leave_groups(_uses_nccl)
    else:
        leave.join(timeout_s)
        if leave.is_alive():
            logger.error("leaving the tensor-parallel process group did not finish within %.0f s; it is left "
                         "as it is (this process cannot start another tensor-parallel engine)", timeout_s)
            return
    _control_group, _uses_nccl = None, False


def _leave_groups(uses_nccl: bool) -> None:
    try:
        if uses_nccl:
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    except Exception:  # shutting down: say so, but let the rest of the shutdown run
        logger.exception("leaving the tensor-parallel process group failed")


def control_group() -> dist.ProcessGroup:
    if _control_group is None:
        raise RuntimeError("the tensor-parallel group is not initialised (init_tensor_parallel was not called)")
    return _control_group


def tp_min(value: int) -> int:
    """The smallest `value` over ranks, on the control group (ranks may reach this at quite different
    times, e.g. after loading weights): each rank's KV-block budget -> the one every rank can hold."""
    if tp_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control_group())
    return int(t.item())


def tp_rank0_object(obj: Any) -> Any:
    """Rank 0's `obj` (pickled over the control group) on every rank: for choices each rank could make
    differently, such as the start-up tuning's, which must be one for all ranks."""
    if tp_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=control_group())
    return box[0]


def enable_symmetric_all_reduce(max_rows: int, hidden: int, dtype: torch.dtype) -> bool:
    """Sum the decoder's row-parallel outputs of up to `max_rows` x `hidden` elements of `dtype`
    (a decode step's) in our Triton kernel that also adds the residual (`nanoinfer.kernels.all_reduce`;
    on two H200s, when it also normalised, 5.5 us at 1 row against 9.8 us for NCCL then the compiled
    add + norm: bench/allreduce.py), over buffers in torch symmetric memory that peers write over NVLink.
    NANOINFER_FUSED_ALL_REDUCE=0 keeps NCCL. Every rank calls this, in the same order: the buffers'
    rendezvous is collective, so the ranks first agree that all of them can: not when torch lacks
    it, nor in a process that set it up for an earlier engine (torch's rendezvous for a new group
    under the same name never completes). Larger inputs (prefill) stay on NCCL. Returns whether
    it is on."""
    global _fused_all_reduce, _symm_used
    if not _uses_nccl or tp_world_size() == 1 or os.environ.get("NANOINFER_FUSED_ALL_REDUCE", "1") == "0":
        return False
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        symm_mem = None
    if tp_min(int(symm_mem is not None and not _symm_used)) == 0:
        logger.info("torch symmetric memory is not available on every rank (or a rank's process set it up "
                    "for an earlier tensor-parallel engine, which torch cannot do twice); all-reduces use NCCL")
        return False
    _symm_used = True
    from nanoinfer.kernels.all_reduce import FusedAllReduce

    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD.group_name
    world, rank = tp_world_size(), tp_rank()

    def symmetric(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        """A zeroed tensor in symmetric memory on every rank: ours (it owns the memory), the peers' views."""
        own = symm_mem.empty(shape, dtype=dtype, device=device)
        own.zero_()
        handle = symm_mem.rendezvous(own, group)
        return [own if r == rank else handle.get_buffer(r, shape, dtype) for r in range(world)]

    slots = FusedAllReduce.SLOTS
    buffers = symmetric((slots, world, max_rows, hidden), dtype)
    ll_buffers = symmetric((slots, world, FusedAllReduce.LL_ROWS, hidden), torch.int64)
    flags = symmetric((slots, FusedAllReduce.MAX_PROGRAMS, world), torch.int32)
    torch.cuda.synchronize()
    dist.barrier(group=control_group())  # every rank's flags are zero before any rank raises one
    _fused_all_reduce = FusedAllReduce(buffers, ll_buffers, flags, rank, max_rows, hidden)
    return True


def fused_all_reduce() -> FusedAllReduce | None:
    """The all-reduce + add kernel's state when it is on (see enable_symmetric_all_reduce)."""
    return _fused_all_reduce


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP group in place (NCCL on GPUs, gloo on CPUs) and return it."""
    if tp_world_size() > 1:
        dist.all_reduce(x)
    return x


def tp_all_reduce_max(x: torch.Tensor) -> torch.Tensor:
    """The elementwise largest `x` over the TP group, in place, and return it."""
    if tp_world_size() > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def tp_broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` on every rank, in place. On GPUs this is ordered on the stream like any kernel
    (no host wait), so workers get each step's sampled tokens on the device in time for the next."""
    if tp_world_size() > 1:
        dist.broadcast(x, src=0)
    return x


def tp_gather_last_dim_to_rank0(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every rank's shard of the last dimension on rank 0 (vocab-parallel logits:
    only rank 0 samples); other ranks get None."""
    world = tp_world_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)] if tp_rank() == 0 else None
    dist.gather(x.contiguous(), parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else None
