"""Does an L2 prefetch of a matmul's weights, issued while a latency-bound kernel runs, make
the matmul faster? (kernels/prefetch.py)

Each case is a CUDA graph of `layers` pairs [window, matmul], the matmul rotating over distinct
weights (so they stream from HBM, as a decode step's layers do), where the window is a kernel that
spins for `--window-us` (torch.cuda._sleep: it reads nothing, like the TP all-reduce or a norm).
Variants: no prefetch, and a prefetch of the next matmul's first `budget` MB (a uniform fraction
of every program's range) launched right before the window. Prints us per pair.

    python bench/prefetch.py [--window-us 3 6] [--budget-mb 4 8 16 24]
"""

from __future__ import annotations

import argparse

import torch

from nanoinfer.kernels import num_sms
from nanoinfer.kernels.prefetch import prefetch_l2, prefetch_plan
from nanoinfer.kernels.skinny_gemm import candidate_configs, graph_seconds_per_call, skinny_linear

SHAPES = {  # (N, K) of the decode matmuls that follow a latency-bound kernel
    "8B-tp2 qkv": (3072, 4096), "8B-tp2 gate_up": (12288, 4096), "8B-tp2 o_proj": (4096, 2048),
    "8B qkv": (6144, 4096), "8B gate_up": (24576, 4096), "0.6B qkv": (4096, 1024), "0.6B gate_up": (6144, 1024),
}


def sleep_cycles(us: float) -> int:
    """Cycles of torch.cuda._sleep that take `us` microseconds (calibrated in a graph)."""
    probe = 100_000
    t = graph_seconds_per_call([lambda: torch.cuda._sleep(probe)] * 10)
    return int(probe * us * 1e-6 / t)


def gemm_seconds(x: torch.Tensor, weights: list[torch.Tensor], config) -> float:
    return graph_seconds_per_call([lambda w=w: skinny_linear(x, w, config=config) for w in weights])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window-us", type=float, nargs="+", default=[3.0, 6.0])
    p.add_argument("--budget-mb", type=float, nargs="+", default=[4, 8, 16, 24])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    args = p.parse_args()
    device = torch.device("cuda")
    print(f"{'shape':<16} {'MB':>6} {'config':<34} {'window':>6}  {'window+gemm us by prefetch budget MB (0 = none)'}")
    for name in args.shapes:
        N, K = SHAPES[name]
        weights = [torch.randn(N, K, device=device, dtype=torch.bfloat16) for _ in range(args.layers)]
        x = torch.randn(1, K, device=device, dtype=torch.bfloat16)
        # The config start-up tuning would pick: the fastest candidate alone.
        configs = candidate_configs(1, N, K, num_sms(device), torch.bfloat16)
        times = [gemm_seconds(x, weights, c) for c in configs]
        config = configs[times.index(min(times))]
        gemm = min(times)
        for window in args.window_us:
            cycles = sleep_cycles(window)
            sleep = graph_seconds_per_call([lambda: torch.cuda._sleep(cycles)] * args.layers)
            row = []
            for budget in [0.0] + args.budget_mb:
                calls = []
                for w in weights:
                    plan = prefetch_plan(w, config.split_k, config.k_per_split(K), int(budget * 2**20))
                    if plan is not None:
                        calls.append(lambda w=w, plan=plan: prefetch_l2(w, plan))
                    calls += [lambda: torch.cuda._sleep(cycles), lambda w=w: skinny_linear(x, w, config=config)]
                t = graph_seconds_per_call(calls) * len(calls) / args.layers
                row.append(f"{budget:g}:{t * 1e6:6.2f}")
            print(f"{name:<16} {N * K * 2 / 1e6:6.1f} {str((config.block_n, config.block_k, config.split_k)):<34}"
                  f" {window:>5.1f}  sleep {sleep * 1e6:5.2f} + gemm {gemm * 1e6:5.2f} = {(sleep + gemm) * 1e6:6.2f} | "
                  + "  ".join(row))
        del weights


if __name__ == "__main__":
    main()
