"""All-reduce latency on 2+ GPUs at the sizes a TP decode step sends (batch x hidden, bf16),
each timed inside a CUDA graph of many calls, as a decode step replays them: NCCL, torch's
symmetric-memory one-shot all-reduce, and what follows a row-parallel layer: NCCL or one-shot,
then the residual add, against our fused all-reduce + add kernel (kernels/all_reduce.py, the
engine's path). bench/NOTES.md, TP section.
    python bench/allreduce.py [--world-size 2] [--hidden 4096]
"""

from __future__ import annotations

import argparse

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
    import torch.distributed._symmetric_memory as symm_mem

    from nanoinfer.distributed import parallel_state as ps

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    ps.init_tensor_parallel(rank, world, rank, store)  # as the engine's ranks do
    rows_list = (1, 8, 64, 256)
    ps.enable_symmetric_all_reduce(max(rows_list), hidden, torch.bfloat16)
    fused = ps.fused_all_reduce()
    staging = symm_mem.empty(max(rows_list) * hidden, dtype=torch.bfloat16, device="cuda")
    symm_mem.rendezvous(staging, dist.group.WORLD.group_name)

    def one_shot(x: torch.Tensor) -> torch.Tensor:
        """Copy into the symmetric buffer, then torch's one-shot all-reduce kernel."""
        staging[: x.numel()].copy_(x.reshape(-1))
        return torch.ops.symm_mem.one_shot_all_reduce(staging[: x.numel()], "sum",
                                                      dist.group.WORLD.group_name).view(x.shape)

    for rows in rows_list:
        torch.manual_seed(rank)
        x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
        residual = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
        want = x.clone()
        dist.all_reduce(want)
        scratch = x.clone()  # NCCL sums in place: time it on a copy (repeated sums overflow, harmlessly)
        nccl = graph_us(lambda: dist.all_reduce(scratch))
        err = ((one_shot(x).float() - want.float()).norm() / want.float().norm()).item()
        line = (f"rows {rows:4d} ({rows * hidden * 2 / 1024:.0f} KB): NCCL {nccl:6.1f} us, symm one-shot (with its "
                f"copy in) {graph_us(lambda: one_shot(x)):6.1f} us (rel err {err:.1e})")
        unfused = graph_us(lambda: one_shot(x) + residual)
        nccl_add = graph_us(lambda: ps.tp_all_reduce(scratch) + residual)
        line += f"; + residual add: NCCL then add {nccl_add:6.1f} us, one-shot then add {unfused:6.1f} us"
        if fused is not None:
            slot = [0]

            def fused_call():
                slot[0] = (slot[0] + 1) % fused.SLOTS  # consecutive calls use different slots, as the decoder's layers do
                return fused(x, residual, slot[0])

            fused_us = graph_us(fused_call)
            same = torch.equal(fused_call(), want + residual)
            line += f", fused kernel {fused_us:6.1f} us (bit-identical: {same})"
        if rank == 0:
            print(line, flush=True)
    dist.barrier()
    ps.destroy_tensor_parallel()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    args = p.parse_args()
    mp.spawn(worker, args=(args.world_size, args.hidden, 29531), nprocs=args.world_size)


if __name__ == "__main__":
    main()
