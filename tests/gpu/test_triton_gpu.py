"""The Triton kernels on CUDA over the full matrix: fp16/bf16, GQA 1/2/4/8 (and 3 and 32: the split merge
pads the first and takes the second in two passes), head_dim 64/128, many context lengths, batches up to 256,
split-KV on and off, the fused norm + rotary + KV write at batch 1000, decode launched longest sequence first and
with balanced splits at Qwen3-0.6B's shape, and a decode step captured in a CUDA graph and replayed at other
lengths.

Run on a GPU machine: `python -m pytest -m gpu tests/gpu`.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

if torch.cuda.is_available():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_triton_kernels import (REL_TOL, fp8_cache, make_batch, make_input_norm, make_qkv_inputs, reference, rel_err,
                                     run_kernel)

    from nanoinfer.attention.torch_backend import TorchAttentionBackend
    from nanoinfer.attention.triton_backend import TritonAttentionBackend
    from nanoinfer.kernels import paged_attention as pa

HEADS = [(8, 8), (8, 4), (8, 2), (16, 2), (12, 4), (64, 2)]  # GQA 1, 2, 4, 8, 3, 32
LENGTHS = [1, 2, 15, 16, 17, 31, 33, 63, 64, 65, 127, 128, 129, 255, 500, 1000, 1023, 2047]


def mixed_lengths(seed):
    """Every context length above with a spread of query lengths: whole prefills,
    prefixes of all sizes, decode rows and chunks ending on block boundaries."""
    rng = random.Random(seed)
    q_lens, seq_lens = [], []
    for seq_len in LENGTHS:
        for q_len in {1, seq_len, rng.randint(1, seq_len), min(seq_len, 16)}:
            q_lens.append(q_len)
            seq_lens.append(seq_len)
    order = list(range(len(q_lens)))
    rng.shuffle(order)
    return [q_lens[i] for i in order], [seq_lens[i] for i in order]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_mixed_prefill_and_decode(dtype, head_dim, num_heads, num_kv_heads):
    q_lens, seq_lens = mixed_lengths(seed=head_dim + num_heads * 10 + num_kv_heads)
    query, k_cache, v_cache, md = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, extra_rows=5)
    out = TritonAttentionBackend().forward(query, k_cache, v_cache, md, head_dim**-0.5)
    assert rel_err(out, reference(query, k_cache, v_cache, md, head_dim**-0.5), sum(q_lens)) < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("num_splits", [1, 8, None])  # None: the heuristic's choice on this GPU
def test_decode_batches(dtype, head_dim, num_heads, num_kv_heads, num_splits):
    rng = random.Random(num_heads + head_dim)
    for batch in (1, 7, 64, 256):
        seq_lens = [rng.choice(LENGTHS + [rng.randint(1, 3000)]) for _ in range(batch)]
        query, k_cache, v_cache, md = make_batch([1] * batch, seq_lens, num_heads, num_kv_heads, head_dim, dtype, seed=batch)
        scale = head_dim**-0.5
        if num_splits is None:
            out = TritonAttentionBackend().forward(query, k_cache, v_cache, md, scale)
        else:
            out = run_kernel(query, k_cache, v_cache, md, scale, num_splits=num_splits)
        assert rel_err(out, reference(query, k_cache, v_cache, md, scale), batch) < REL_TOL[dtype], f"batch {batch}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("dim_major_v", [True, False])
def test_fp8_cache_mixed_and_decode(dtype, num_heads, num_kv_heads, dim_major_v):
    """An fp8 KV cache (kv_cache_dtype="fp8"): mixed batches and decode batches up to 256 give the
    reference's output over the same fp8 values, V dim-major (the engine's layout) or as K."""
    q_lens, seq_lens = mixed_lengths(seed=num_heads + num_kv_heads)
    batches = [(q_lens, seq_lens)] + [([1] * b, random.Random(b).choices(LENGTHS, k=b)) for b in (1, 7, 256)]
    for q_lens, seq_lens in batches:
        query, k_cache, v_cache, md = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, 128, dtype)
        k8, v8, v8_token_major = fp8_cache(k_cache, v_cache, md, dim_major_v=dim_major_v)
        out = TritonAttentionBackend().forward(query, k8, v8, md, 128**-0.5)
        ref = reference(query, k8, v8_token_major, md, 128**-0.5)
        assert rel_err(out, ref, sum(q_lens)) < REL_TOL[dtype], f"{len(q_lens)} seqs"


@pytest.mark.parametrize("cache", ["bfloat16", "fp8"])
@pytest.mark.parametrize("num_splits,balance", [(None, 0), (8, 0), (4, 8 * 132)])  # None: launch_config's choice
def test_decode_longest_first_and_balanced_splits_at_scale(cache, num_splits, balance):
    """Qwen3-0.6B's attention shape (16 / 8 heads, head_dim 128) at batches of 1-256 with unequal contexts, as
    the engine launches decode (`seq_order`: longest sequence first): bit for bit the output of the launch in
    batch order (each (sequence, KV head) does the same work, only on another program), and within the
    reference's tolerance; with the default splits, 8 equal ones, and 4 balanced over 8 programs per SM."""
    rng = random.Random(num_splits or 0)
    for batch in (1, 7, 64, 256):
        seq_lens = [rng.choice(LENGTHS + [rng.randint(1, 3000)]) for _ in range(batch)]
        query, k_cache, v_cache, md = make_batch([1] * batch, seq_lens, 16, 8, 128, torch.bfloat16, seed=batch)
        if cache == "fp8":
            k_cache, v_cache, _ = fp8_cache(k_cache, v_cache, md, dim_major_v=True)
        config = TritonAttentionBackend().launch_config(query, k_cache, md)
        if num_splits is not None:
            config = dataclasses.replace(config, num_splits=num_splits, block_n=64, max_registers=None,
                                         balance_programs=balance)
        args = (query, k_cache, v_cache, md.query_start_loc, md.seq_lens, md.block_tables, 128**-0.5)
        out = pa.paged_attention(*args, max_query_len=1, config=config)
        longest_first = torch.argsort(md.seq_lens, descending=True, stable=True).to(torch.int32)
        ordered = pa.paged_attention(*args, max_query_len=1, config=config, seq_order=longest_first)
        assert torch.equal(ordered, out), f"batch {batch}"
        ref = reference(query, k_cache, v_cache, md, 128**-0.5)  # the reference gathers by index: any V layout
        assert rel_err(out, ref, batch) < REL_TOL[torch.bfloat16], f"batch {batch}"


def test_float32_uses_exact_dot():
    q_lens, seq_lens = mixed_lengths(seed=3)
    query, k_cache, v_cache, md = make_batch(q_lens, seq_lens, 8, 2, 128, torch.float32)
    out = TritonAttentionBackend().forward(query, k_cache, v_cache, md, 0.1)
    assert rel_err(out, reference(query, k_cache, v_cache, md, 0.1), sum(q_lens)) < REL_TOL[torch.float32]


def test_long_prefix_chunk():
    """A 512-token chunk over a 3000-token cached prefix, next to decode rows."""
    query, k_cache, v_cache, md = make_batch([512, 1, 1], [3512, 3000, 40], 16, 8, 128, torch.bfloat16)
    out = TritonAttentionBackend().forward(query, k_cache, v_cache, md, 128**-0.5)
    assert rel_err(out, reference(query, k_cache, v_cache, md, 128**-0.5), 514) < REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotate_and_cache_large_batch_with_padding(dtype, qk_norm):
    k_cache, v_cache = torch.randn(2, 300, 16, 8, 128, device="cuda").to(dtype)
    qkv, positions, rope, (q_norm, k_norm) = make_qkv_inputs(1000, 16, 8, 128, dtype, qk_norm=qk_norm)
    input_norm = make_input_norm(1000, 1024, dtype, bias_width=qkv.shape[1])
    slot_mapping = torch.randperm(300 * 16, device="cuda")[:1000]
    slot_mapping[::7] = -1
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_q = TorchAttentionBackend().rotate_and_cache(qkv, positions, rope, q_norm, k_norm, ref_k, ref_v, slot_mapping, 16,
                                                     input_norm)
    query = TritonAttentionBackend().rotate_and_cache(qkv, positions, rope, q_norm, k_norm, k_cache, v_cache,
                                                      slot_mapping, 16, input_norm)
    # The same rounding steps as the PyTorch path; fused multiply-adds and the norm's float32 rsqrt may move
    # the last bit.
    ulp = 2**-10 if dtype == torch.float16 else 2**-7
    torch.testing.assert_close(query, ref_q, rtol=ulp, atol=ulp * ref_q.abs().max().item())
    torch.testing.assert_close(k_cache, ref_k, rtol=ulp, atol=ulp * ref_k.abs().max().item())
    torch.testing.assert_close(v_cache, ref_v, rtol=ulp, atol=ulp * ref_v.abs().max().item())


@pytest.mark.parametrize("batch,max_len", [(2, 2000), (64, 600)])  # split-KV on, off
def test_decode_step_replays_in_cuda_graph(batch, max_len):
    """Capture rotate_and_cache + forward once, then replay with every sequence one token
    longer and fresh inputs: the graph must read lengths and positions from device memory."""
    rng = random.Random(batch)
    seq_lens = [rng.randint(1, max_len - 40) for _ in range(batch)]
    _, k_cache, v_cache, md = make_batch([1] * batch, [s + 30 for s in seq_lens], 16, 8, 128, torch.bfloat16)
    md.seq_lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
    md.seq_lens_cpu, md.max_seq_len = seq_lens, max_len  # captured for the bucket's max length
    backend = TritonAttentionBackend()
    qkv, _, rope, (q_norm, k_norm) = make_qkv_inputs(batch, 16, 8, 128, torch.bfloat16, qk_norm=True)
    input_norm = make_input_norm(batch, 1024, torch.bfloat16)
    positions = torch.tensor(seq_lens, device="cuda") - 1

    def slots_for(lengths):
        pos = torch.tensor(lengths, device="cuda") - 1
        return md.block_tables[torch.arange(batch, device="cuda"), pos // 16].long() * 16 + pos % 16

    def step():
        query = backend.rotate_and_cache(qkv, positions, rope, q_norm, k_norm, k_cache, v_cache, md.slot_mapping, 16,
                                         input_norm)
        return query, backend.forward(query, k_cache, v_cache, md, 128**-0.5)

    md.slot_mapping.copy_(slots_for(seq_lens))
    for _ in range(2):  # compile and warm up outside the capture
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        query, out = step()
    for step_index in range(1, 4):
        lengths = [s + step_index for s in seq_lens]
        md.seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        md.slot_mapping.copy_(slots_for(lengths))
        positions.copy_(torch.tensor(lengths, device="cuda") - 1)
        qkv.normal_()
        graph.replay()
        md.seq_lens_cpu = lengths
        ref_q = TorchAttentionBackend().rotate_and_cache(qkv, positions, rope, q_norm, k_norm, k_cache.clone(),
                                                         v_cache.clone(), md.slot_mapping, 16, input_norm)
        torch.testing.assert_close(query, ref_q, rtol=2**-7, atol=2**-7 * ref_q.abs().max().item())
        assert rel_err(out, reference(query, k_cache, v_cache, md, 128**-0.5), batch) < REL_TOL[torch.bfloat16]
