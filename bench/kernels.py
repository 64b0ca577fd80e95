"""GPU micro-benchmark of our paged-attention kernels, Qwen3-0.6B attention shape
(16 query heads, 8 KV heads, head_dim 128, block 16, bf16 queries; the KV cache in
bf16, or in fp8 with --kv-cache-dtype fp8; other head counts with --heads Q,KV).

Decode time is one attention call, taken from CUDA-graph replays of many calls
(as the engine's decode step runs), each call over its own block table into a
4 GiB cache pool so the data is not L2-resident between calls. Bytes counted
per call are the ones it must move: K and V of every context token, block-table
entries, the query read and the output written; achieved GB/s = bytes / time,
compared with a device-to-device copy (bytes read + written).

With --gemm it benchmarks only the skinny (M <= 16) matmul against cuBLAS on
Qwen3-0.6B and Qwen3-8B (TP=2 shard) projection shapes: CUDA-graph replays of
many calls rotating over enough weight copies to exceed L2 several times, so
each call streams its weight from HBM; TB/s = weight bytes / time.

Usage: PYTHONPATH=. python bench/kernels.py [--quick | --decode-sweep | --decode-mix | --prefill-mix] [--kv-cache-dtype fp8]
       [--heads 32,4] [--gemm] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch
import triton

from nanoinfer.kernels.rotate_and_cache import rotate_and_cache
from nanoinfer.layers.attention import v_cache_view
from nanoinfer.kernels.attention_config import DECODE_BLOCK_N, PagedAttentionConfig, choose_config
from nanoinfer.kernels.paged_attention import paged_attention
from nanoinfer.model_runner.cuda_graph import batch_size_buckets
from nanoinfer.kernels.skinny_gemm import SkinnyConfig, graph_seconds_per_call, skinny_linear
from nanoinfer.kernels.skinny_gemm import choose_config as choose_skinny_config

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 16, 8, 128, 16, torch.bfloat16
HIDDEN_SIZE = 1024  # the residual stream rows the deferred input norm's r comes from
ELEM = 2
POOL_BYTES = 4 << 30
L2_MULTIPLE = 4  # rotate over at least this many L2-sizes of data per replay


def copy_bandwidth() -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus written."""
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


class Pool:
    """One big K/V cache (bf16 or fp8) that every benchmark call draws blocks from."""

    def __init__(self, cache_dtype: torch.dtype = DTYPE) -> None:
        block_bytes = 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * cache_dtype.itemsize
        self.num_blocks = POOL_BYTES // block_bytes
        kv = torch.empty(2, self.num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=cache_dtype)
        for part in kv.view(-1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).split(1 << 12):  # no full-size bf16 temporary
            part.copy_(torch.randn(part.shape, device="cuda", dtype=DTYPE))
        self.k_cache, self.v_cache = kv[0], v_cache_view(kv[1])  # the engine's layouts
        self.l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
        self.num_sms = torch.cuda.get_device_properties(0).multi_processor_count


def decode_bytes(pool: Pool, lens: list[int]) -> int:
    """Bytes one decode call over contexts of these lengths must move."""
    kv = sum(lens) * NUM_KV_HEADS * HEAD_DIM * pool.k_cache.element_size() * 2
    table = sum(triton.cdiv(n, BLOCK_SIZE) for n in lens) * 4
    q_and_out = 2 * len(lens) * NUM_HEADS * HEAD_DIM * ELEM
    return kv + table + q_and_out


def decode_calls(pool: Pool, lens: list[int], config: PagedAttentionConfig, in_order: bool = False,
                 seed: int | None = None, longest_first: bool = True):
    """Closures over disjoint block tables (one row per context length), enough of them to exceed L2 several
    times. Blocks are placed at random (a used cache) or, `in_order`, consecutively (a fresh cache's free queue);
    the same `seed` gives the same blocks and queries, so configs can be compared output for output.
    `longest_first`: the launch takes the sequences longest first (`seq_order`), as the engine launches decode."""
    if seed is not None:
        torch.manual_seed(seed)
    batch, width = len(lens), triton.cdiv(max(lens), BLOCK_SIZE)
    blocks_per_call = sum(triton.cdiv(n, BLOCK_SIZE) for n in lens)
    per_call = decode_bytes(pool, lens)
    reps = max(1, min(pool.num_blocks // blocks_per_call, triton.cdiv(L2_MULTIPLE * pool.l2_bytes, per_call), 512))
    perm = (torch.arange if in_order else torch.randperm)(pool.num_blocks, device="cuda").to(torch.int32)
    rows = torch.arange(width, device="cuda")
    lengths = torch.tensor(lens, device="cuda", dtype=torch.int32)
    used = (lengths + BLOCK_SIZE - 1) // BLOCK_SIZE
    starts = torch.cumsum(used, 0) - used
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    query_start_loc = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    seq_order = torch.argsort(lengths, descending=True, stable=True).to(torch.int32) if longest_first else None
    calls = []
    for r in range(reps):
        taken = perm[r * blocks_per_call : (r + 1) * blocks_per_call]
        index = (starts[:, None] + rows[None, :]).clamp(max=blocks_per_call - 1)
        block_tables = torch.where(rows[None, :] < used[:, None], taken[index], 0).to(torch.int32)

        def call(block_tables=block_tables):
            return paged_attention(
                query, pool.k_cache, pool.v_cache, query_start_loc, lengths, block_tables, HEAD_DIM**-0.5,
                max_query_len=1, config=config, seq_order=seq_order,
            )

        calls.append(call)
    return calls


def default_config(pool: Pool, batch: int, ctx: int, max_query_len: int = 1) -> PagedAttentionConfig:
    return choose_config(
        num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, dtype=DTYPE, max_query_len=max_query_len,
        num_seqs=batch, max_seq_len=ctx, num_sms=pool.num_sms, cache_dtype=pool.k_cache.dtype,
    )


def bench_decode(pool: Pool, lens: list[int], config: PagedAttentionConfig, in_order: bool = False) -> dict:
    seconds = graph_seconds_per_call(decode_calls(pool, lens, config, in_order), replays=20)
    nbytes = decode_bytes(pool, lens)
    return {"batch": len(lens), "ctx": round(sum(lens) / len(lens)), "max_ctx": max(lens), "splits": config.num_splits,
            "us": seconds * 1e6, "bytes": nbytes, "gbps": nbytes / seconds / 1e9}


def prefill_case(pool: Pool, q_len: int, ctx: int):
    """One sequence: q_len new tokens over a ctx-token context (ctx - q_len cached).
    Returns (run(config) -> output, torch SDPA reference closure, causal FLOPs)."""
    blocks = triton.cdiv(ctx, BLOCK_SIZE)
    block_tables = torch.randperm(pool.num_blocks, device="cuda")[:blocks].to(torch.int32).view(1, -1)
    query = torch.randn(q_len, NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    query_start_loc = torch.tensor([0, q_len], device="cuda", dtype=torch.int32)
    seq_lens = torch.tensor([ctx], device="cuda", dtype=torch.int32)

    def run(config: PagedAttentionConfig) -> torch.Tensor:
        return paged_attention(
            query, pool.k_cache, pool.v_cache, query_start_loc, seq_lens, block_tables, HEAD_DIM**-0.5,
            max_query_len=q_len, config=config,
        )

    # Yardstick and reference: torch SDPA on the same keys laid out contiguously.
    q = query.transpose(0, 1).unsqueeze(0).contiguous()
    k = pool.k_cache[block_tables[0].long()].flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0).to(DTYPE).contiguous()
    v = pool.v_cache[block_tables[0].long()].flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0).to(DTYPE).contiguous()
    mask = None if q_len == ctx else torch.ones(q_len, ctx, device="cuda", dtype=torch.bool).tril(ctx - q_len)

    def sdpa() -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)

    visible = sum(ctx - q_len + i + 1 for i in range(q_len))
    return run, sdpa, 4 * NUM_HEADS * HEAD_DIM * visible


def bench_prefill(pool: Pool, q_len: int, ctx: int, configs: list[PagedAttentionConfig]) -> list[dict]:
    run, sdpa, flops = prefill_case(pool, q_len, ctx)
    ref = sdpa().float()
    sdpa_ms = triton.testing.do_bench(sdpa, warmup=25, rep=100, return_mode="median")
    return [{"q_len": q_len, "ctx": ctx, "sdpa_us": sdpa_ms * 1e3, **dataclasses.asdict(config),
             **time_prefill(run, config, ref, flops)} for config in configs]


def time_prefill(run, config: PagedAttentionConfig, reference: torch.Tensor, flops: int) -> dict:
    """One prefill config: its error against `reference`, us per call and TFLOP/s, or the error that stopped it."""
    try:
        out = run(config).float()
        ms = triton.testing.do_bench(lambda: run(config), warmup=25, rep=100, return_mode="median")
        return {"rel_err": ((out - reference).norm() / reference.norm()).item(), "us": ms * 1e3,
                "tflops": flops / ms / 1e9}
    except Exception as exc:  # out of shared memory etc.: record and go on
        return {"error": type(exc).__name__}


def prefill_tiles(base: PagedAttentionConfig, block_ns: tuple[int, ...]) -> list[PagedAttentionConfig]:
    """Prefill tile variants around `base`: 64 or 128 rows, these steps, 4 or 8 warps, 2 or 3 stages."""
    group = NUM_HEADS // NUM_KV_HEADS
    return [dataclasses.replace(base, block_m=block_m, block_q=block_m // group, block_n=block_n,
                                num_warps=num_warps, num_stages=num_stages)
            for block_m in (64, 128) for block_n in block_ns for num_warps in (4, 8) for num_stages in (2, 3)]


def bench_rotate_and_cache(pool: Pool, num_tokens: int) -> dict:
    """The deferred input norm + Qwen3's per-head norms + rotary + KV write in one kernel (the step's QKV and
    residual rows in, queries out)."""
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    qkv = torch.randn(num_tokens, width, device="cuda", dtype=DTYPE)
    hidden = torch.randn(num_tokens, HIDDEN_SIZE, device="cuda", dtype=DTYPE)
    positions = torch.randint(0, 4096, (num_tokens,), device="cuda")
    cos, sin = torch.randn(2, 4096, HEAD_DIM // 2, device="cuda")
    norm_weight = torch.ones(HEAD_DIM, device="cuda", dtype=DTYPE)
    slots = torch.randperm(pool.num_blocks * BLOCK_SIZE, device="cuda")[:num_tokens]

    def run():
        rotate_and_cache(qkv, positions, cos, sin, norm_weight, norm_weight, 1e-6, pool.k_cache, pool.v_cache, slots,
                         NUM_HEADS, hidden, 1e-6)

    ms = graph_seconds_per_call([run] * 50) * 1e3  # in a CUDA graph, as the decode step runs it
    # qkv and residual rows read, queries and K/V (in the cache's dtype) written, positions, slots and the cos/sin
    # rows read.
    kv_bytes = 2 * num_tokens * NUM_KV_HEADS * HEAD_DIM * pool.k_cache.element_size()
    nbytes = ((qkv.numel() + hidden.numel() + num_tokens * NUM_HEADS * HEAD_DIM) * ELEM + kv_bytes
              + num_tokens * (16 + 2 * HEAD_DIM * 4))
    return {"tokens": num_tokens, "us": ms * 1e3, "gbps": nbytes / (ms * 1e-3) / 1e9}


def bench_fused_elementwise(num_tokens: int, hidden: int = 1024, intermediate: int = 3072) -> dict:
    """RMSNorm and SiLU-and-mul (its deferred norm's r from x's rows; Qwen3-0.6B widths): our Triton
    kernels against the same math torch.compile'd as the engine fused it before, device time in a CUDA graph
    and host time per eager call (what an eager prefill step pays)."""
    import time

    from nanoinfer.kernels.activation import silu_and_mul
    from nanoinfer.kernels.rms_norm import rms_norm
    from nanoinfer.layers.activation import silu_and_mul_math
    from nanoinfer.layers.layernorm import DeferredNorm, rms_norm_math

    x = torch.randn(num_tokens, hidden, device="cuda", dtype=DTYPE)
    weight = torch.rand(hidden, device="cuda", dtype=DTYPE) + 0.5
    gate_up = torch.randn(num_tokens, 2 * intermediate, device="cuda", dtype=DTYPE)
    input_norm = DeferredNorm(x, 1e-6)
    norm_c, silu_c = torch.compile(rms_norm_math, dynamic=True), torch.compile(silu_and_mul_math, dynamic=True)
    calls = {
        "rms_norm triton": lambda: rms_norm(x, weight, 1e-6),
        "rms_norm compiled": lambda: norm_c(x, weight, 1e-6),
        "silu_and_mul triton": lambda: silu_and_mul(gate_up, x, 1e-6),
        "silu_and_mul compiled": lambda: silu_c(gate_up, input_norm),
    }
    row = {"tokens": num_tokens}
    for name, call in calls.items():
        row[f"{name} us"] = graph_seconds_per_call([call] * 20) * 1e6
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            call()
        row[f"{name} host us"] = (time.perf_counter() - start) / 20 * 1e6
        torch.cuda.synchronize()
    return row


def sweep_decode_configs(pool: Pool) -> list[dict]:
    """Tile shapes for decode (no split) on shapes with enough programs to fill the GPU; for an fp8
    cache also 32-token steps and the register cap, with blocks at random and in order."""
    fp8 = pool.k_cache.dtype == torch.float8_e4m3fn
    variants = ([(n, 2, r) for n in (32, 64, 128) for r in (None, 128)] if fp8
                else [(n, w, None) for n in (64, 128) for w in (2, 4)])
    rows = []
    for batch, ctx in [(256, 1000), (256, 2000), (128, 1100), (64, 1000), (32, 500)]:
        base = default_config(pool, batch, ctx)
        for block_n, num_warps, registers in variants:
            cfg = dataclasses.replace(base, block_n=block_n, num_warps=num_warps, num_stages=3, num_splits=1,
                                      max_registers=registers)
            for in_order in (False, True) if fp8 else (False,):
                rows.append({**bench_decode(pool, [ctx] * batch, cfg, in_order), "block_n": block_n, "num_warps": num_warps,
                             "max_registers": registers, "in_order": in_order, "default": cfg == base})
    print("\ndecode config sweep (us per call, no split, 3 stages; * = the default config):")
    for r in rows:
        print(f"  b{r['batch']} ctx{r['ctx']} N{r['block_n']} w{r['num_warps']} regs {r['max_registers']}"
              f" {'in order' if r['in_order'] else 'random'}: {r['us']:.1f}{' *' if r['default'] else ''}")
    return rows


def sweep_splits(pool: Pool) -> list[dict]:
    """Split counts where sequences x KV heads leave SMs idle, against the heuristic."""
    rows = []
    for batch in (1, 4, 8, 16, 32, 64):
        for ctx in (100, 500, 2000):
            base = default_config(pool, batch, ctx)
            row = {"batch": batch, "ctx": ctx, "heuristic": base.num_splits}
            for splits in (1, 2, 4, 8, 16, 32):
                row[splits] = bench_decode(pool, [ctx] * batch, dataclasses.replace(base, num_splits=splits))["us"]
            rows.append(row)
    print("\nsplit sweep (us per call; * = heuristic):")
    print("  batch  ctx " + "".join(f"{s:>9}" for s in (1, 2, 4, 8, 16, 32)))
    for row in rows:
        cells = "".join(f"{row[s]:>8.1f}{'*' if s == row['heuristic'] else ' '}" for s in (1, 2, 4, 8, 16, 32))
        print(f"  {row['batch']:>5} {row['ctx']:>4} {cells}")
    return rows


def workload_contexts(step: int, max_num_seqs: int = 256) -> list[int]:
    """Context lengths of the reference workload's decode step `step` (every prompt is prefilled before decode
    starts, and a request leaves after max_tokens), padded with length-1 rows to the CUDA-graph bucket as the
    engine's graph runner pads them."""
    from throughput import workload

    prompts, params = workload(max_num_seqs)
    lens = [len(p) + step for p, sp in zip(prompts, params) if sp.max_tokens > step]
    bucket = next(b for b in batch_size_buckets(max_num_seqs) if b >= len(lens))
    return lens + [1] * (bucket - len(lens))


def sweep_decode_mix(pool: Pool, max_model_len: int = 2048) -> list[dict]:
    """Decode attention over the reference workload's own context mixes (unequal lengths: the longest is 1.2-1.8x
    the mean), with the launch the engine's CUDA graph captures (max_model_len) against split counts with
    per-sequence equal splits (balance 0) or balanced splits (`balance_programs` per SM x SMs), each launched in
    batch order and longest first ("lpt", as the engine launches decode)."""
    rows = []
    for step in (50, 200, 400, 600, 800, 900):
        lens = workload_contexts(step)
        base = default_config(pool, len(lens), max_model_len)
        reference = decode_calls(pool, lens, base, seed=step)[0]().float()
        variants = [("default", base)] + [
            (f"S{splits} r{regs} b{per_sm}", dataclasses.replace(base, block_n=DECODE_BLOCK_N, num_splits=splits,
                                                                 max_registers=regs,
                                                                 balance_programs=per_sm * pool.num_sms))
            for splits in (2, 4, 8) for regs in (None, 128) for per_sm in (0, 4, 8, 16)
        ]
        variants += [(name + " lpt", config) for name, config in variants]  # longest sequences first
        real = [n for n in lens if n > 1]
        row = {"step": step, "seqs": len(real), "bucket": len(lens), "mean_ctx": round(sum(real) / len(real)),
               "max_ctx": max(lens), "bytes": decode_bytes(pool, lens)}
        for name, config in variants:
            calls = decode_calls(pool, lens, config, seed=step, longest_first=name.endswith("lpt"))
            error = ((calls[0]().float() - reference).norm() / reference.norm()).item()
            row[name] = graph_seconds_per_call(calls, replays=20) * 1e6
            if error > 1e-2:
                row[name + " error"] = error
        rows.append(row)
        timed = {k: v for k, v in row.items() if k.startswith(("default", "S")) and not k.endswith("error")}
        best = min(timed, key=timed.get)
        print(f"  step {step}: {row['seqs']} seqs (bucket {row['bucket']}), ctx mean {row['mean_ctx']} max {row['max_ctx']}: "
              f"default {row['default']:.1f} us ({row['bytes'] / row['default'] / 1e3:.0f} GB/s), best {best} "
              f"{row[best]:.1f} us; " + ", ".join(f"{k} {v:.1f}" for k, v in timed.items() if k != "default"), flush=True)
        errors = {k: v for k, v in row.items() if k.endswith("error")}
        if errors:
            print(f"    outputs differ from the default's: {errors}")
    return rows


def prefill_mix_case(pool: Pool, budget: int = 16384):
    """The reference workload's first mixed step: its prompts in order until the token budget (the offline
    engine's 16,384 on an H200; the last one a chunk), each over a fresh context. Returns (run(config) ->
    output, causal FLOPs, prompt lengths)."""
    from throughput import workload

    prompts, _ = workload(256)
    lens, used = [], 0
    for p in prompts:
        lens.append(min(len(p), budget - used))
        used += lens[-1]
        if used == budget:
            break
    starts = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    width = triton.cdiv(max(lens), BLOCK_SIZE)
    perm = torch.randperm(pool.num_blocks, device="cuda").to(torch.int32)
    block_tables = perm[: len(lens) * width].view(len(lens), width)  # disjoint rows, some blocks unused
    query = torch.randn(used, NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)

    def run(config: PagedAttentionConfig) -> torch.Tensor:
        return paged_attention(query, pool.k_cache, pool.v_cache, starts, seq_lens, block_tables, HEAD_DIM**-0.5,
                               max_query_len=max(lens), config=config)

    return run, sum(4 * NUM_HEADS * HEAD_DIM * n * (n + 1) // 2 for n in lens), lens


def sweep_prefill_mix(pool: Pool) -> list[dict]:
    """Prefill tiles on the workload's own mixed step (~30 prompts of 100-1,024 tokens), against the default."""
    run, flops, lens = prefill_mix_case(pool)
    base = default_config(pool, len(lens), max(lens), max(lens))
    reference = run(base).float()
    rows = [dataclasses.asdict(config) | {"default": config == base} | time_prefill(run, config, reference, flops)
            for config in [base] + prefill_tiles(base, (64, 128))]
    ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    print(f"\nprefill over the workload's first mixed step ({len(lens)} prompts, {sum(lens)} tokens; us, TFLOP/s, "
          f"rel err vs the default; * = default):")
    for r in ok[:8] + [r for r in ok[8:] if r["default"]]:
        print(f"  M{r['block_m']}/N{r['block_n']}/w{r['num_warps']}/s{r['num_stages']}: {r['us']:.0f} us "
              f"{r['tflops']:.0f} TFLOP/s {r['rel_err']:.0e}{' *' if r['default'] else ''}")
    return rows


def sweep_prefill(pool: Pool) -> list[dict]:
    rows = []
    for q_len, ctx in [(2048, 2048), (512, 2048), (8192, 8192)]:
        rows += bench_prefill(pool, q_len, ctx, prefill_tiles(default_config(pool, 1, ctx, q_len), (32, 64, 128)))
    print("\nprefill config sweep (best 6 per shape; us, TFLOP/s, rel err vs sdpa):")
    for q_len, ctx in [(2048, 2048), (512, 2048), (8192, 8192)]:
        ok = sorted((r for r in rows if (r["q_len"], r["ctx"]) == (q_len, ctx) and "us" in r), key=lambda r: r["us"])
        bad = [r for r in rows if (r["q_len"], r["ctx"]) == (q_len, ctx) and r.get("rel_err", 0.0) > 1e-2]
        cells = ", ".join(f"M{r['block_m']}/N{r['block_n']}/w{r['num_warps']}/s{r['num_stages']}={r['us']:.0f}/{r['tflops']:.0f}/{r['rel_err']:.0e}" for r in ok[:6])
        print(f"  q{q_len} ctx{ctx}: {cells}  (inaccurate configs: {len(bad)})")
    return rows


# ----- skinny GEMM (decode-sized linear layers): --gemm -----

# (N, K) of each projection: Qwen3-0.6B, and Qwen3-8B's per-rank shard at TP=2.
GEMM_SHAPES = {
    "0.6B": {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
    "8B-tp2": {"qkv": (3072, 4096), "o_proj": (4096, 2048), "gate_up": (12288, 4096), "down": (4096, 6144)},
}
GEMM_MS = (1, 2, 4, 8, 16)
GEMM_LAYERS = {"0.6B": 28, "8B-tp2": 36}


def gemm_weights(N: int, K: int, l2_bytes: int) -> list[torch.Tensor]:
    """Enough bf16 copies of an [N, K] weight that one pass over them exceeds L2 several times,
    so every call streams its weight from HBM (as successive layers of a decode step do)."""
    per_copy = N * K * ELEM
    copies = max(2, min(64, triton.cdiv(L2_MULTIPLE * l2_bytes, per_copy)))
    return [torch.randn(N, K, device="cuda", dtype=DTYPE) / K**0.5 for _ in range(copies)]


def gemm_seconds(fn, x: torch.Tensor, weights: list[torch.Tensor], min_calls: int = 64) -> float:
    """Seconds per call of fn(x, w) from CUDA-graph replays rotating over `weights`."""
    rounds = triton.cdiv(min_calls, len(weights))
    return graph_seconds_per_call([lambda w=w: fn(x, w) for w in weights] * rounds, replays=20)


def bench_gemm(num_sms: int, l2_bytes: int, copy_bw: float) -> list[dict]:
    rows = []
    for model, shapes in GEMM_SHAPES.items():
        for name, (N, K) in shapes.items():
            weights = gemm_weights(N, K, l2_bytes)
            nbytes = N * K * ELEM
            for M in GEMM_MS:
                x = torch.randn(M, K, device="cuda", dtype=DTYPE)
                ref = torch.nn.functional.linear(x, weights[0]).float()
                err = ((skinny_linear(x, weights[0]).float() - ref).norm() / ref.norm()).item()
                t_cublas = gemm_seconds(torch.nn.functional.linear, x, weights)
                t_skinny = gemm_seconds(skinny_linear, x, weights)
                config = choose_skinny_config(M, N, K, num_sms, DTYPE)
                rows.append({
                    "model": model, "proj": name, "M": M, "N": N, "K": K, "mbytes": nbytes / 1e6,
                    "cublas_us": t_cublas * 1e6, "skinny_us": t_skinny * 1e6,
                    "cublas_tbps": nbytes / t_cublas / 1e12, "skinny_tbps": nbytes / t_skinny / 1e12,
                    "predicted_us": nbytes / copy_bw * 1e6 + 2.0,  # bytes at the copy's HBM rate + ~2 us ramp
                    "rel_err": err, "config": dataclasses.asdict(config), "grid": config.grid(N),
                })
            del weights
    print(f"\nskinny GEMM vs cuBLAS (bf16, CUDA graphs, weights not L2-resident); copy rate (read + write) {copy_bw / 1e12:.2f} TB/s")
    print("  model   proj       M      N      K    MB   cuBLAS us  TB/s   skinny us  TB/s  pred us  speedup  grid      rel err")
    for r in rows:
        print(
            f"  {r['model']:<7} {r['proj']:<8} {r['M']:>3} {r['N']:>6} {r['K']:>6} {r['mbytes']:>5.1f} {r['cublas_us']:>10.2f} {r['cublas_tbps']:>5.2f}"
            f" {r['skinny_us']:>10.2f} {r['skinny_tbps']:>5.2f} {r['predicted_us']:>8.2f} {r['cublas_us'] / r['skinny_us']:>7.2f}x"
            f"  {r['grid'][0]}x{r['grid'][1]:<5} {r['rel_err']:.1e}"
        )
    for model, layers in [(m, n) for m, n in GEMM_LAYERS.items() if m in GEMM_SHAPES]:
        for M in GEMM_MS:
            sel = [r for r in rows if r["model"] == model and r["M"] == M]
            cublas = layers * sum(r["cublas_us"] for r in sel)
            best = layers * sum(min(r["cublas_us"], r["skinny_us"]) for r in sel)
            print(f"  {model} M={M:>2}: {layers} layers of GEMMs {cublas / 1e3:.3f} ms with cuBLAS, {best / 1e3:.3f} ms with the faster of the two")
    return rows


def sweep_gemm(num_sms: int, l2_bytes: int) -> list[dict]:
    """Launch parameters around the heuristic at M=1 and M=16, to retune `choose_config`:
    tile x split first (4 warps, stages as the heuristic), then warps x stages for the best."""
    rows = []
    for model, shapes in GEMM_SHAPES.items():
        for name, (N, K) in shapes.items():
            weights = gemm_weights(N, K, l2_bytes)
            for M in (1, 16):
                x = torch.randn(M, K, device="cuda", dtype=DTYPE)
                base = choose_skinny_config(M, N, K, num_sms, DTYPE)

                def timed(config: SkinnyConfig) -> float:
                    try:
                        return gemm_seconds(lambda x, w: skinny_linear(x, w, config=config), x, weights) * 1e6
                    except Exception as exc:  # out of shared memory etc.: skip
                        print(f"    {config}: {type(exc).__name__}")
                        return float("inf")

                results = {base: timed(base)}
                for block_n in (16, 32, 64):
                    for block_k in (64, 128, 256):
                        for split in (1, 2, 4, 8, 16):
                            if split > 1 and triton.cdiv(K, block_k) < 2 * split:
                                continue
                            config = dataclasses.replace(base, block_n=block_n, block_k=block_k, split_k=split, num_warps=4)
                            if config not in results:
                                results[config] = timed(config)
                best = min(results, key=results.get)
                for num_warps in (2, 4, 8):
                    for num_stages in (2, 3, 4, 5, 6):
                        config = dataclasses.replace(best, num_warps=num_warps, num_stages=num_stages)
                        if config not in results:
                            results[config] = timed(config)
                ranked = sorted(results, key=results.get)
                row = {"model": model, "proj": name, "M": M, "N": N, "K": K, "heuristic": dataclasses.asdict(base),
                       "heuristic_us": results[base],
                       "ranked": [{**dataclasses.asdict(c), "us": results[c]} for c in ranked[:10]]}
                rows.append(row)
                top = ", ".join(f"n{c.block_n}/k{c.block_k}/s{c.split_k}/w{c.num_warps}/st{c.num_stages}={results[c]:.2f}" for c in ranked[:5])
                print(f"  {model} {name} M={M}: heuristic n{base.block_n}/k{base.block_k}/s{base.split_k}/w{base.num_warps}/"
                      f"st{base.num_stages}={results[base]:.2f} us; best: {top}")
    return rows


def heads_arg(text: str) -> tuple[int, int]:
    """argparse type of --heads Q,KV: query and KV heads, Q a multiple of KV."""
    num_heads, num_kv_heads = (int(n) for n in text.split(","))
    if num_heads % num_kv_heads:
        raise argparse.ArgumentTypeError(f"{text}: query heads must be a multiple of KV heads")
    return num_heads, num_kv_heads


def main() -> None:
    global NUM_HEADS, NUM_KV_HEADS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the config and split sweeps")
    parser.add_argument("--gemm", action="store_true",
                        help="only the skinny-GEMM section (cuBLAS vs skinny_linear at M <= 16; with a config sweep unless --quick)")
    parser.add_argument("--gemm-model", choices=sorted(GEMM_SHAPES), default=None,
                        help="with --gemm: only this model's shapes")
    parser.add_argument("--decode-sweep", action="store_true", help="only the decode tile sweep")
    parser.add_argument("--decode-mix", action="store_true",
                        help="only decode over the reference workload's context mixes: split counts and balancing")
    parser.add_argument("--prefill-mix", action="store_true",
                        help="only prefill tiles over the reference workload's first mixed step")
    parser.add_argument("--kv-cache-dtype", choices=("bf16", "fp8"), default="bf16",
                        help="the attention benchmarks' cache: bf16, or float8_e4m3fn as kv_cache_dtype='fp8' stores it")
    parser.add_argument("--heads", type=heads_arg, default=(NUM_HEADS, NUM_KV_HEADS), metavar="Q,KV",
                        help="the attention benchmarks' query and KV heads (Qwen3-30B-A3B: 32,4; Qwen3-8B: 32,8)")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "kernels_bench.json"))
    args = parser.parse_args()
    NUM_HEADS, NUM_KV_HEADS = args.heads
    torch.manual_seed(0)
    results: dict = {"device": torch.cuda.get_device_name(0), "triton": triton.__version__, "torch": torch.__version__,
                     "heads": [NUM_HEADS, NUM_KV_HEADS]}
    copy_bw = copy_bandwidth()
    results["copy_gbps"] = copy_bw / 1e9
    if args.gemm:
        if args.gemm_model is not None:
            for model in [m for m in GEMM_SHAPES if m != args.gemm_model]:
                del GEMM_SHAPES[model]
        props = torch.cuda.get_device_properties(0)
        print(f"{results['device']}  triton {triton.__version__}  copy {copy_bw / 1e9:.0f} GB/s  SMs {props.multi_processor_count}"
              f"  L2 {props.L2_cache_size >> 20} MiB")
        if not args.quick:
            print("\nskinny GEMM config sweep (us per call):")
            results["gemm_sweep"] = sweep_gemm(props.multi_processor_count, props.L2_cache_size)
        results["gemm"] = bench_gemm(props.multi_processor_count, props.L2_cache_size, copy_bw)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        return
    pool = Pool(torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else DTYPE)
    results["kv_cache_dtype"] = str(pool.k_cache.dtype)
    print(f"{results['device']}  triton {triton.__version__}  copy {copy_bw / 1e9:.0f} GB/s  SMs {pool.num_sms}  L2 {pool.l2_bytes >> 20} MiB"
          f"  KV cache {pool.k_cache.dtype}  heads {NUM_HEADS} / {NUM_KV_HEADS}")
    if args.decode_sweep or args.decode_mix or args.prefill_mix:
        if args.decode_sweep:
            results["decode_config_sweep"] = sweep_decode_configs(pool)
        if args.prefill_mix:
            results["prefill_mix"] = sweep_prefill_mix(pool)
        if args.decode_mix:
            print("\ndecode over the reference workload's context mixes (us per call):")
            results["decode_mix"] = sweep_decode_mix(pool)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        return
    if not args.quick:
        results["decode_config_sweep"] = sweep_decode_configs(pool)
        results["split_sweep"] = sweep_splits(pool)
        results["prefill_sweep"] = sweep_prefill(pool)

    prefill = [
        bench_prefill(pool, q, c, [default_config(pool, 1, c, q)])[0] for q, c in [(2048, 2048), (512, 2048), (8192, 8192)]
    ]
    results["prefill"] = prefill
    rope_runs = [bench_rotate_and_cache(pool, n) for n in (1, 256, 8192)]
    results["rotate_and_cache"] = rope_runs
    fused_runs = [bench_fused_elementwise(n) for n in (1, 128, 256, 8192)]
    results["fused_elementwise"] = fused_runs
    decode = []
    for batch in (1, 4, 16, 64, 256):
        for ctx in (100, 500, 1000, 2000):
            decode.append(bench_decode(pool, [ctx] * batch, default_config(pool, batch, ctx)))
    results["decode"] = decode
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)

    print("\nprefill, default config (one sequence, bf16):")
    for r in prefill:
        print(
            f"  q {r['q_len']:>5} ctx {r['ctx']:>5} M{r['block_m']}/N{r['block_n']}: {r['us']:8.1f} us {r['tflops']:6.1f} TFLOP/s"
            f"  rel err {r['rel_err']:.1e}  (torch sdpa {r['sdpa_us']:.1f} us)"
        )
    print("rotate_and_cache:", ", ".join(f"{r['tokens']} tokens {r['us']:.1f} us {r['gbps']:.0f} GB/s" for r in rope_runs))
    print("fused elementwise (device us in a graph / host us per eager call):")
    for r in fused_runs:
        names = sorted({k.rsplit(" us", 1)[0].replace(" host", "") for k in r if k != "tokens"})
        print(f"  {r['tokens']:>5} tokens: " + ", ".join(f"{n} {r[n + ' us']:.1f} / {r[n + ' host us']:.0f}" for n in names))
    print(f"\ndecode attention, default config, per call (CUDA graph); copy rate {copy_bw / 1e9:.0f} GB/s")
    print("  batch   ctx splits       us    MB read     GB/s  % copy")
    for r in decode:
        print(
            f"  {r['batch']:>5} {r['ctx']:>5} {r['splits']:>6} {r['us']:>8.1f} {r['bytes'] / 1e6:>10.2f} {r['gbps']:>8.0f} {100 * r['gbps'] * 1e9 / copy_bw:>6.1f}"
        )


if __name__ == "__main__":
    main()
