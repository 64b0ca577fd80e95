"""All-reduce latency on 2+ GPUs at the sizes a TP decode step sends (batch x hidden, bf16),
each timed inside a CUDA graph of many calls, as a decode step replays them: NCCL, torch's
symmetric-memory one-shot all-reduce (the engine's path for the embedding), and what follows a
row-parallel layer: one-shot + compiled add + RMSNorm against our fused kernel
(kernels/all_reduce.py, the engine's path). bench/NOTES.md, TP section.
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
    from nanoinfer.distributed import parallel_state as ps
    from nanoinfer.layers.fusion import set_fusion
    from nanoinfer.layers.layernorm import add_rms_norm

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    ps.init_tensor_parallel(rank, world, rank, store)  # as the engine's ranks do
    rows_list = (1, 8, 64, 256)
    symm = ps.enable_symmetric_all_reduce(max(rows_list), hidden, torch.bfloat16)
    fused = ps.fused_all_reduce()
    set_fusion(True)  # add + RMSNorm compiled, as on the engine's GPU path
    weight = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    for rows in rows_list:
        torch.manual_seed(rank)
        x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
        residual = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
        nccl = graph_us(lambda: dist.all_reduce(x))
        line = f"rows {rows:4d} ({rows * hidden * 2 / 1024:.0f} KB): NCCL {nccl:6.1f} us"
        if symm:
            want = x.clone()
            dist.all_reduce(want)
            err = ((ps.tp_all_reduce(x).float() - want.float()).norm() / want.float().norm()).item()
            one_shot = graph_us(lambda: ps.tp_all_reduce(x))  # copy into the buffer + torch's one-shot kernel
            line += f", symm one-shot (with its copy in) {one_shot:6.1f} us (rel err {err:.1e})"
        if fused is not None:
            slot = [0]

            def fused_call():
                slot[0] ^= 1  # consecutive calls alternate buffers, as the decoder's norms do
                return fused(x, residual, weight, 1e-6, slot[0])

            unfused = graph_us(lambda: add_rms_norm(ps.tp_all_reduce(x), residual, weight, 1e-6))
            fused_us = graph_us(fused_call)
            diff = (fused_call()[0].float() - add_rms_norm(want, residual, weight, 1e-6)[0].float()).abs().max().item()
            line += (f"; + add + RMSNorm: one-shot then compiled {unfused:6.1f} us, fused kernel {fused_us:6.1f} us "
                     f"(max abs diff {diff:.1e})")
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
