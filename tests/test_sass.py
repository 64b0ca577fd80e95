"""Codegen guards, checked without a GPU: our kernels compiled for sm_90 by Triton's own ptxas
(bench/sass.py), their instruction mix read from the SASS."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import sass  # noqa: E402  (bench/sass.py)

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for the GPU, not the interpreter"),
    pytest.mark.skipif(not (sass._BIN / "cuobjdump").exists(), reason="this triton ships no NVIDIA tools"),
]


def test_fp8_decode_reads_v_from_shared_memory_without_byte_loads():
    """The fp8 cache keeps V dim-major inside each block so that the decode loop's P x V operands come
    out of shared memory several bytes at a time; with V laid out as K, every operand byte is its own
    load (no transposing ldmatrix for 8-bit types), 16-18% slower on an H200 (bench/RESULTS.md)."""
    engine = sass.attention_report(torch.float8_e4m3fn)
    token_major = sass.attention_report(torch.float8_e4m3fn, token_major_v=True)
    assert engine.loops and token_major.loops
    assert sum(loop.count("LDS.U8") for loop in engine.loops) == 0
    assert sum(loop.count("LDS.U8") for loop in token_major.loops) >= 64
    assert engine.spill_bytes == 0


def test_split_merge_sums_a_gqa8_groups_splits_elementwise():
    """Decode at one sequence splits its context, and the last split merges the splits of all the query heads of
    its KV head (Qwen3-30B-A3B's 32 / 4: eight). Its loop, the kernel's last, sums each step's splits
    elementwise: at most 8 barriers (the weights' broadcast) where a reduction over a [heads, splits, dim] tile
    crossed warps (34 in Triton 3.9) and the merge head by head had no loop but a chain of reductions per head."""
    report = sass.attention_report(torch.bfloat16, batch=1, heads=(32, 4))
    assert len(report.loops) >= 3  # the metadata sum, the KV loop, the merge
    assert sum(op.startswith("BAR") for op in report.loops[-1]) <= 8
    assert report.spill_bytes == 0


@pytest.mark.parametrize("tokens", [1, 1024])
def test_fp8_experts_convert_each_weight_pair_in_one_instruction(tokens):
    """The fused MoE's GEMMs on fp8 experts in a bf16 model multiply in float16, so each pair of e4m3 weights
    becomes float16 in one F2FP; on bfloat16 activations every value took an F2F more (and a PRMT per pair),
    which bound the GEMM by conversions, not bytes (bench/NOTES.md, 2026-11-29)."""
    for name, report in sass.moe_reports(fp8=True, tokens=tokens).items():
        loop = max(report.loops, key=len)
        assert sum(op.startswith("F2FP.F16.E4M3") for op in loop) >= 16, name
        assert not any(op.startswith("F2F.") for op in loop), name
        assert report.spill_bytes == 0, name
    bf16 = max(sass.moe_reports(fp8=True, tokens=tokens, fp16_activations=False)["gated"].loops, key=len)
    assert sum(op.startswith("F2F.BF16") for op in bf16) >= 32  # what this test guards against
