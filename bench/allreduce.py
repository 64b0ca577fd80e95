"""All-reduce latency on 2+ GPUs at the sizes a TP decode step sends (batch x hidden, bf16):
NCCL (what the engine uses) against torch's symmetric-memory one-shot all-reduce, each timed
inside a CUDA graph of many calls, as a decode step replays them. Decides whether the
symmetric-memory path is worth building (bench/NOTES.md, TP section).
    python bench/allreduce.py [--world-size 2] [--hidden 4096]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CALLS = 100


def graph_us(fn) -> float:
    """Microseconds per call of `fn` over replays of a graph of CALLS calls (median of 5)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(5):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return sorted(times)[2]


def worker(rank: int, world: int, hidden: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    group = dist.group.WORLD.group_name
    rows_list = (1, 8, 64, 256)
    symm = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm = symm_mem.empty(max(rows_list) * hidden, dtype=torch.bfloat16, device=f"cuda:{rank}")
        symm_mem.rendezvous(symm, group)
    except Exception as exc:  # report and go on with NCCL only
        if rank == 0:
            print(f"symmetric memory unavailable: {type(exc).__name__}: {exc}")
        symm = None
    for rows in rows_list:
        x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
        nccl = graph_us(lambda: dist.all_reduce(x))
        line = f"rows {rows:4d} ({rows * hidden * 2 / 1024:.0f} KB): NCCL {nccl:6.1f} us"
        if symm is not None:
            buf = symm[: rows * hidden]
            torch.manual_seed(rank)
            local = torch.randn(rows * hidden, dtype=torch.bfloat16, device="cuda")
            buf.copy_(local)
            want = local.clone()
            dist.all_reduce(want)
            try:
                got = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group)
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                one_shot = graph_us(lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group))
                copy_in = graph_us(lambda: buf.copy_(local))
                line += f", symm one-shot {one_shot:6.1f} us (+ copy in {copy_in:4.1f} us), rel err {err:.1e}"
            except Exception as exc:
                line += f", symm one-shot failed: {type(exc).__name__}: {str(exc)[:200]}"
        if rank == 0:
            print(line, flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    args = p.parse_args()
    mp.spawn(worker, args=(args.world_size, args.hidden, 29531), nprocs=args.world_size)


if __name__ == "__main__":
    main()
