"""PROBE (branch ropeheads, not for main): the fused norms + rotary + KV write with several heads per program
(NANOINFER_ROPE_HEADS), timed inside a CUDA graph as the decode step runs it, bf16 and fp8 caches, Qwen3-0.6B heads.
One H200, ~1 min: cd bench && PYTHONPATH=.. python3 rope_heads_probe.py"""
import os

import torch

import kernels as kb
from nanoinfer.kernels.rotate_and_cache import rotate_and_cache
from nanoinfer.kernels.skinny_gemm import graph_seconds_per_call

for dtype in (torch.bfloat16, torch.float8_e4m3fn):
    pool = kb.Pool(dtype)
    for num_tokens in (1, 16, 64, 256, 1024, 8192):
        width = (kb.NUM_HEADS + 2 * kb.NUM_KV_HEADS) * kb.HEAD_DIM
        qkv = torch.randn(num_tokens, width, device="cuda", dtype=kb.DTYPE)
        positions = torch.randint(0, 4096, (num_tokens,), device="cuda")
        cos, sin = torch.randn(2, 4096, kb.HEAD_DIM // 2, device="cuda")
        weight = torch.ones(kb.HEAD_DIM, device="cuda", dtype=kb.DTYPE)
        slots = torch.randperm(pool.num_blocks * kb.BLOCK_SIZE, device="cuda")[:num_tokens]
        line, outs = [], []
        for heads in ("1", "2", "4", "8", "24"):
            os.environ["NANOINFER_ROPE_HEADS"] = heads

            def call(pool=pool):
                return rotate_and_cache(qkv, positions, cos, sin, weight, weight, 1e-6, pool.k_cache, pool.v_cache,
                                        slots, kb.NUM_HEADS)

            outs.append(call())
            line.append(f"h{heads}: {graph_seconds_per_call([call] * 50) * 1e6:6.2f} us")
        same = all(torch.equal(o, outs[0]) for o in outs)
        print(f"{str(dtype)[6:]:>13} tokens {num_tokens:5d}: " + " | ".join(line) + f" | same queries: {same}", flush=True)
    del pool
    torch.cuda.empty_cache()
