"""GPU micro-benchmark of the fused MoE kernels (kernels/moe.py) on one Qwen3-30B-A3B layer's experts (128 experts
of 768, hidden 2048, 8 per token, bf16), against transformers' experts module on the same weights (its loop over
the experts in use, eager: the peer).

Per batch size T: the routing (the gate's matmul, then softmax and top-k as the engine runs them:
`select_experts`) and `fused_moe`, timed from CUDA-graph replays rotating over enough layers' experts that no
replay finds its weights in L2, as a decode step's layers do. Bytes
counted are those a call must read: the weights of every expert in use (the uniform random router uses nearly all
of them from T ~ 64; half as many bytes for the same experts in fp8, `quantization="fp8"`'s layout) plus the
activations; TB/s = bytes / time, against a device-to-device copy's rate
(bytes read + written, bench/kernels.py's measure).

`--sweep bf16|fp8` instead times each GEMM's tile candidates around `choose_config` (the other GEMM at its
default) at T = 1 .. 4096 and prints the best per batch size, to retune it.

Usage: PYTHONPATH=. python bench/moe_kernel.py [--json PATH] [--sweep bf16|fp8]  (bench/gpu_suite.sh moe runs it)
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
import triton

from kernels import copy_bandwidth

import nanoinfer.kernels.moe as moe_kernels
from nanoinfer.kernels.moe import GemmConfig, choose_block_m, fused_moe
from nanoinfer.kernels.skinny_gemm import graph_seconds_per_call
from nanoinfer.layers.moe import fused_moe_math, quantize_experts, select_experts

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, DTYPE = 2048, 768, 128, 8, torch.bfloat16
BATCHES = (1, 8, 32, 64, 128, 256, 1024, 4096)
LAYERS = 4  # 4 x 1.2 GB of experts: far over L2


def quantized(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A layer's experts as `quantization="fp8"` stores them: (w13, w2, their float32 row scales)."""
    (q13, s13), (q2, s2) = quantize_experts(w13), quantize_experts(w2)
    return q13, q2, s13, s2


def moe_calls(x: torch.Tensor, experts: list[tuple[torch.Tensor, ...]], routed: list[tuple]) -> list:
    """One `fused_moe` call per layer: its experts (w13, w2[, w13_scale, w2_scale]) and routing."""
    return [lambda e=e, r=r: fused_moe(x, *e[:2], *r, None, *e[2:]) for e, r in zip(experts, routed)]


def bench(T: int, layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], fp8_layers: list[tuple]) -> dict:
    x = torch.randn(T, HIDDEN, device="cuda", dtype=DTYPE)
    gates = [gate for gate, _, _ in layers]
    routed = [select_experts(F.linear(x, gate), TOP_K, True) for gate in gates]
    t_route = graph_seconds_per_call([lambda g=g: select_experts(F.linear(x, g), TOP_K, True) for g in gates],
                                     replays=20)
    bf16_layers = [(w13, w2) for _, w13, w2 in layers]
    t_moe = graph_seconds_per_call(moe_calls(x, bf16_layers, routed), replays=20)
    t_fp8 = graph_seconds_per_call(moe_calls(x, fp8_layers, routed), replays=20)
    used = torch.unique(routed[0][1]).numel()  # (layer 0's routing stands for the rotation's: the same T, uniform)
    weight_bytes, activation_bytes = used * 3 * HIDDEN * INTERMEDIATE, T * HIDDEN * 2 * 2
    nbytes, fp8_bytes = 2 * weight_bytes + activation_bytes, weight_bytes + activation_bytes
    errors = []
    for experts in (bf16_layers[0], fp8_layers[0]):
        ours = moe_calls(x, [experts], routed[:1])[0]().float()
        reference = fused_moe_math(x, *experts[:2], *routed[0], *experts[2:]).float()
        errors.append(((ours - reference).norm() / reference.norm()).item())
    return {"T": T, "experts_used": used, "mbytes": nbytes / 1e6, "route_us": t_route * 1e6, "moe_us": t_moe * 1e6,
            "moe_tbps": nbytes / t_moe / 1e12, "rel_err_vs_math": errors[0], "fp8_us": t_fp8 * 1e6,
            "fp8_tbps": fp8_bytes / t_fp8 / 1e12, "fp8_rel_err_vs_math": errors[1]}


def candidates(block_m: int, gated: bool) -> list[GemmConfig]:
    """Tiles around the heuristic's: decode-sized blocks (16 rows) are weight-bandwidth bound (column and K tiles,
    stages), prefill blocks are compute bound (tiles and warps)."""
    if block_m <= 16:
        return [GemmConfig(n, k, 4, st) for n in ((16, 32, 64) if gated else (64, 128)) for k in (128, 256)
                for st in (3, 4, 5)]
    return [GemmConfig(n, k, w, 3) for n in (64, 128) for k in (64, 128) for w in (4, 8)]


def sweep(dtype: str, layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], fp8_layers: list[tuple]) -> list:
    """Per T and GEMM: each candidate's us per fused_moe call (graph replays, as `bench` times them) with the
    other GEMM at `choose_config`'s tiles; prints the default and the best three."""
    default = moe_kernels.choose_config
    rows = []
    for T in BATCHES:
        x = torch.randn(T, HIDDEN, device="cuda", dtype=DTYPE)
        routed = [select_experts(F.linear(x, gate), TOP_K, True) for gate, _, _ in layers]
        calls = moe_calls(x, fp8_layers if dtype == "fp8" else [(w13, w2) for _, w13, w2 in layers], routed)
        block_m = choose_block_m(T * TOP_K, EXPERTS)
        for gated in (True, False):
            timed = []
            for config in candidates(block_m, gated):
                moe_kernels.choose_config = (lambda bm, N, K, g, fp8=False, c=config, want=gated:
                                             c if g == want else default(bm, N, K, g, fp8))
                try:
                    timed.append((graph_seconds_per_call(calls, replays=10) * 1e6, config))
                except Exception as e:  # a tile that does not compile (shared memory) is skipped, and said
                    print(f"  T={T} gated={gated} {config}: {type(e).__name__}")
                finally:
                    moe_kernels.choose_config = default
            timed.sort(key=lambda pair: pair[0])
            base = default(block_m, INTERMEDIATE if gated else HIDDEN, HIDDEN if gated else INTERMEDIATE, gated,
                           dtype == "fp8")
            base_us = graph_seconds_per_call(calls, replays=10) * 1e6
            print(f"{dtype} T={T:>5} {'gated' if gated else 'plain'}: default {base} {base_us:.1f} us; best "
                  + "; ".join(f"{c} {us:.1f}" for us, c in timed[:3]), flush=True)
            rows.append({"dtype": dtype, "T": T, "gated": gated, "default_us": base_us,
                         "best": [(us, vars(c)) for us, c in timed[:3]]})
    return rows


def peer_seconds(T: int, layer: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> float:
    """transformers' Qwen3MoeExperts (its per-expert loop, eager) on the same weights and routing."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, num_experts=EXPERTS,
                            num_experts_per_tok=TOP_K)
    with torch.device("meta"):
        experts = Qwen3MoeExperts(config)
    gate, w13, w2 = layer
    experts.gate_up_proj, experts.down_proj = torch.nn.Parameter(w13), torch.nn.Parameter(w2)
    x = torch.randn(T, HIDDEN, device="cuda", dtype=DTYPE)
    weights, ids = select_experts(F.linear(x, gate), TOP_K, True)
    with torch.no_grad():
        experts(x, ids.long(), weights.to(DTYPE))
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            experts(x, ids.long(), weights.to(DTYPE))
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="where the figures go (default $OUT/moe_kernel.json, with --sweep "
                                        "$OUT/moe_sweep_<dtype>.json)")
    parser.add_argument("--sweep", choices=("bf16", "fp8"), help="retune the GEMM tiles instead")
    args = parser.parse_args()
    args.json = args.json or os.path.join(os.environ.get("OUT", "."), f"moe_sweep_{args.sweep}.json" if args.sweep
                                          else "moe_kernel.json")
    torch.manual_seed(0)
    rate = copy_bandwidth()
    layers = [(torch.randn(EXPERTS, HIDDEN, device="cuda", dtype=DTYPE) / HIDDEN**0.5,
               torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, device="cuda", dtype=DTYPE) / HIDDEN**0.5,
               torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, device="cuda", dtype=DTYPE) / INTERMEDIATE**0.5)
              for _ in range(LAYERS)]
    fp8_layers = [quantized(w13, w2) for _, w13, w2 in layers]
    if args.sweep:
        with open(args.json, "w") as f:
            json.dump(sweep(args.sweep, layers, fp8_layers), f, indent=1)
        return
    rows = []
    for T in BATCHES:
        row = bench(T, layers, fp8_layers)
        row["peer_us"] = peer_seconds(T, layers[0]) * 1e6
        rows.append(row)
    device = torch.cuda.get_device_name(0)
    print(f"{device}  triton {triton.__version__}  torch {torch.__version__}  "
          f"copy (read + write) {rate / 1e12:.2f} TB/s")
    print("fused MoE, one Qwen3-30B-A3B layer's experts (bf16 activations, CUDA graphs, weights not L2-resident;"
          " MB and % copy: the bf16 experts'; fp8: the same experts quantized per row)")
    print("      T  experts     MB   route us   moe us   TB/s  % copy  rel err   fp8 us  fp8 TB/s  fp8 err"
          "  transformers us")
    for r in rows:
        print(f"  {r['T']:>5} {r['experts_used']:>8} {r['mbytes']:>6.0f} {r['route_us']:>10.1f} {r['moe_us']:>8.1f}"
              f" {r['moe_tbps']:>6.2f} {100 * r['moe_tbps'] * 1e12 / rate:>7.1f}  {r['rel_err_vs_math']:.1e}"
              f" {r['fp8_us']:>8.1f} {r['fp8_tbps']:>9.2f}  {r['fp8_rel_err_vs_math']:.1e} {r['peer_us']:>16.1f}")
    with open(args.json, "w") as f:
        json.dump({"device": device, "copy_tbps": rate / 1e12, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
