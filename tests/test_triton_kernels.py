"""Our Triton rotate-and-cache and paged-attention kernels against the PyTorch reference.

Without CUDA the kernels run in Triton's interpreter, in a child pytest (tests/triton_child.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from triton_child import RUN_HERE, interpreter_child, kernel_test

from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.attention.torch_backend import TorchAttentionBackend, to_cache_dtype
from nanoinfer.layers.attention import dim_major_view

if RUN_HERE:
    from nanoinfer.attention import triton_backend
    from nanoinfer.kernels import arrival_counters
    from nanoinfer.kernels import attention_config as ac
    from nanoinfer.kernels import paged_attention as pa
    from nanoinfer.kernels import rotate_and_cache as rc

test_cpu_interpreter_child = interpreter_child(__file__)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 16
# ||out - ref|| / ||ref|| against a float64 reference (measured in the interpreter:
# fp32 ~1e-7, fp16 ~3e-4; bounds leave a few times headroom).
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, *, extra_rows=0, seed=0,
               block_size=BLOCK_SIZE):
    """Random query and paged cache (built on DEVICE, so the GPU tests reuse it at
    batch 256). Every cache slot outside a sequence's context (spare blocks, the
    tail of a last block, block-table padding) holds NaN, so any read the kernel
    should have masked poisons the output."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1  # block 0: table padding
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    slots, used = [], 0
    for i, (seq_len, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[i, :nb] = perm[used : used + nb]
        used += nb
        pos = torch.arange(seq_len)
        slots.append(block_tables[i, pos // block_size].long() * block_size + pos % block_size)
    slots = torch.cat(slots).to(DEVICE)
    cache = torch.full((2, num_blocks * block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    cache[:, slots] = torch.randn(2, len(slots), num_kv_heads, head_dim, generator=gen, device=DEVICE).to(dtype)
    cache = cache.view(2, num_blocks, block_size, num_kv_heads, head_dim)
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens + extra_rows, num_heads, head_dim, generator=gen, device=DEVICE).to(dtype)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    metadata = AttentionMetadata(
        slot_mapping=torch.full((num_tokens + extra_rows,), -1, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
    )
    return query, cache[0], cache[1], metadata


def reference(query, k_cache, v_cache, metadata, scale):
    return TorchAttentionBackend().forward(query.double(), k_cache.double(), v_cache.double(), metadata, scale)


def rel_err(out, ref, num_tokens):
    out, ref = out[:num_tokens].double(), ref[:num_tokens]
    assert torch.isfinite(out).all(), "non-finite output: a masked cache slot was read"
    return ((out - ref).norm() / ref.norm()).item()


def run_kernel(query, k_cache, v_cache, metadata, scale, **overrides):
    """The backend's forward with some of its launch configuration pinned."""
    backend = triton_backend.TritonAttentionBackend()
    config = dataclasses.replace(backend.launch_config(query, k_cache, metadata), **overrides)
    return backend.forward(query, k_cache, v_cache, metadata, scale, config)


# (q_lens, seq_lens): a decode row, a prefill over a cached prefix, a fresh
# prefill, a chunk ending on a block boundary; lengths 15/16/17/33 straddle blocks.
MIXED = ([1, 5, 15, 16, 17], [17, 33, 15, 32, 17])


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (4, 1)])
def test_mixed_batch_matches_reference(dtype, num_heads, num_kv_heads):
    query, k_cache, v_cache, md = make_batch(*MIXED, num_heads, num_kv_heads, 64, dtype, extra_rows=3)
    out = run_kernel(query, k_cache, v_cache, md, 0.125)
    assert out.shape == query.shape and out.dtype == dtype
    assert rel_err(out, reference(query, k_cache, v_cache, md, 0.125), sum(MIXED[0])) < REL_TOL[dtype]


@kernel_test
def test_small_query_tiles_span_several_tiles_per_sequence():
    """block_q below the query lengths: sequences own several tiles and the
    program -> (sequence, tile) search has to land every tile. The last
    sequence's first row sees 15 keys, one short of a block_n step: the
    unmasked/masked boundary must not round it up."""
    query, k_cache, v_cache, md = make_batch([7, 1, 20, 3], [40, 9, 20, 17], 4, 2, 64, torch.float32)
    out = run_kernel(query, k_cache, v_cache, md, 0.1, block_q=4, block_m=16, block_n=16)
    assert rel_err(out, reference(query, k_cache, v_cache, md, 0.1), 31) < REL_TOL[torch.float32]


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_splits,balance_programs", [(1, 0), (4, 0), (4, 16)])
def test_decode_matches_reference(dtype, num_splits, balance_programs):
    """With block_n 16 and 4 splits, short contexts need fewer splits (the rest exit
    at once) and the longest (70) spans all four: the merge (in the last split to
    arrive) must count and weight only the splits with work, and leave every arrival counter at zero for the next launch.
    Balanced over 16 programs, splits are at least 152 x 2 / 16 -> 32 tokens: 70 takes three, 33 two, the rest
    one (stored as final, no merge). Run twice: the second launch reuses the counters."""
    seq_lens = [1, 15, 16, 17, 33, 70]
    query, k_cache, v_cache, md = make_batch([1] * len(seq_lens), seq_lens, 8, 2, 64, dtype, extra_rows=2)
    for _ in range(2):
        out = run_kernel(query, k_cache, v_cache, md, 0.125, block_n=16, num_splits=num_splits,
                         balance_programs=balance_programs)
        assert rel_err(out, reference(query, k_cache, v_cache, md, 0.125), len(seq_lens)) < REL_TOL[dtype]
        assert int(arrival_counters(query.device, 1).abs().sum()) == 0


@kernel_test
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (6, 2), (16, 2), (32, 1)])
def test_split_merge_combines_every_query_head_of_a_group(num_heads, num_kv_heads):
    """The merge takes a group's query heads together (up to 16: 32 per KV head take two passes; 3 pad to 4)
    and their splits a few per step (merge_tile): a context of 130 tokens in 16-token splits needs 9, so GQA
    1 / 2 / 3 / 8 / 32 merge in 1 / 1 / 2 / 3 / 5 steps; one of 1030 in 32-token splits (64 allowed: the split
    axis is 64 wide; under a register cap, half the splits per step) needs 33, past any chunk boundary. Every
    head's output is the reference's. The next token row's sequence runs first (seq_order), so a padding head
    stored past its group would stay in that row."""
    assert [ac.merge_tile(g) for g in (1, 2, 3, 8, 32)] == [(1, 32), (2, 16), (4, 8), (8, 4), (16, 2)]
    assert [ac.merge_tile(g, max_registers=128) for g in (1, 2, 8, 32)] == [(1, 16), (2, 8), (8, 2), (16, 1)]
    for longest, num_splits, cap in ((130, 16, None), (1030, 64, 128)):  # capped: half the rows per step
        seq_lens = [longest, 1, 17, 33]
        query, k_cache, v_cache, md = make_batch([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, 32,
                                                 torch.float32)
        config = dataclasses.replace(triton_backend.TritonAttentionBackend().launch_config(query, k_cache, md),
                                     block_n=16, num_splits=num_splits, balance_programs=0, max_registers=cap)
        out = pa.paged_attention(query, k_cache, v_cache, md.query_start_loc, md.seq_lens, md.block_tables, 0.125,
                                 max_query_len=1, config=config,
                                 seq_order=torch.tensor([1, 0, 2, 3], dtype=torch.int32, device=DEVICE))
        ref = reference(query, k_cache, v_cache, md, 0.125)
        for head in range(num_heads):
            assert rel_err(out[:, head], ref[:, head], len(seq_lens)) < REL_TOL[torch.float32], \
                f"context {longest}, query head {head}"
        assert int(arrival_counters(query.device, 1).abs().sum()) == 0


@kernel_test
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_in_seq_order_gives_the_same_output(num_splits):
    """`seq_order` only changes which program takes which (sequence, KV head) pair: longest first or any
    permutation, the output is bit for bit the launch's without it, split or not. It is rejected on a prefill
    config and when it is not one int32 entry per sequence."""
    seq_lens = [1, 15, 70, 17, 33, 16]
    query, k_cache, v_cache, md = make_batch([1] * len(seq_lens), seq_lens, 8, 2, 64, torch.float16)
    config = dataclasses.replace(triton_backend.TritonAttentionBackend().launch_config(query, k_cache, md),
                                 block_n=16, num_splits=num_splits)
    args = (query, k_cache, v_cache, md.query_start_loc, md.seq_lens, md.block_tables, 0.125)
    plain = pa.paged_attention(*args, max_query_len=1, config=config)
    longest_first = torch.argsort(md.seq_lens, descending=True, stable=True).to(torch.int32)
    for order in (longest_first, torch.randperm(len(seq_lens), device=DEVICE).to(torch.int32)):
        assert torch.equal(pa.paged_attention(*args, max_query_len=1, config=config, seq_order=order), plain)
    for bad_config, bad_order in ((dataclasses.replace(config, decode=False, num_splits=1), longest_first),
                                  (config, longest_first.long()), (config, longest_first[:-1])):
        with pytest.raises(ValueError, match="seq_order is for decode configs"):
            pa.paged_attention(*args, max_query_len=1, config=bad_config, seq_order=bad_order)


def fp8_cache(k_cache, v_cache, metadata, *, dim_major_v: bool):
    """make_batch's cache in fp8, as the engine keeps one: V dim-major inside each block (`dim_major_view`)
    and, since such a V is read in whole blocks, finite in the unwritten tail of each sequence's last
    block (300.0 here, what an earlier owner of the block might have left: weighting it would show);
    spare blocks and table padding stay NaN. Returns K, V and V token-major (the same values)."""
    v_cache, block_size = v_cache.clone(), v_cache.shape[1]
    for i, seq_len in enumerate(metadata.seq_lens_cpu):
        v_cache[int(metadata.block_tables[i, (seq_len - 1) // block_size]), (seq_len - 1) % block_size + 1:] = 300.0
    k8, v8 = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)  # NaN stays NaN
    if not dim_major_v:
        return k8, v8, v8
    v_dim = dim_major_view(torch.empty_like(v8))
    v_dim.copy_(v8)
    return k8, v_dim, v8


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [None, 4])  # None: a mixed batch; 4: split decode
@pytest.mark.parametrize("dim_major_v", [True, False])
def test_fp8_cache_matches_reference_on_the_stored_values(dtype, num_splits, dim_major_v):
    """An fp8 KV cache: the kernel upcasts K and V as it loads them (bf16 queries: the dots run in
    fp16), so it gives the reference's output over the same fp8 values, at the query dtype's tolerance,
    with V in the engine's dim-major layout and in K's."""
    q_lens, seq_lens = MIXED if num_splits is None else ([1] * 5, [1, 16, 17, 33, 70])
    query, k_cache, v_cache, md = make_batch(q_lens, seq_lens, 4, 2, 64, dtype)
    k8, v8, v8_token_major = fp8_cache(k_cache, v_cache, md, dim_major_v=dim_major_v)
    overrides = {} if num_splits is None else dict(block_n=16, num_splits=num_splits, max_registers=128)
    out = run_kernel(query, k8, v8, md, 0.125, **overrides)
    assert rel_err(out, reference(query, k8, v8_token_major, md, 0.125), sum(q_lens)) < REL_TOL[dtype]


@kernel_test
@pytest.mark.parametrize("block_n", [16, 64])  # a step inside one 32-token block, or two whole blocks
@pytest.mark.parametrize("decode", [False, True])
def test_fp8_cache_with_32_token_blocks(block_n, decode):
    """A dim-major fp8 V is read in whole (block, KV head) runs when a step covers whole blocks, and per
    dim in pieces of the step's tokens when a step is shorter than a block: both give the reference."""
    q_lens, seq_lens = ([1] * 4, [1, 31, 33, 70]) if decode else MIXED
    query, k_cache, v_cache, md = make_batch(q_lens, seq_lens, 4, 2, 64, torch.bfloat16, block_size=32)
    k8, v8, v8_token_major = fp8_cache(k_cache, v_cache, md, dim_major_v=True)
    overrides = dict(block_n=block_n) | (dict(num_splits=2, max_registers=128) if decode else {})
    out = run_kernel(query, k8, v8, md, 0.125, **overrides)
    assert rel_err(out, reference(query, k8, v8_token_major, md, 0.125), sum(q_lens)) < REL_TOL[torch.bfloat16]


def test_dim_major_view_keeps_block_ids_and_puts_tokens_of_a_dim_together():
    cache = torch.arange(3 * 4 * 2 * 8).view(3, 4, 2, 8)  # [blocks, block_size, kv_heads, head_dim]
    view = dim_major_view(cache)
    assert view.shape == cache.shape and view.stride()[1] == 1 and view.data_ptr() == cache.data_ptr()
    # In memory: block, then head, then dim, then slot.
    assert view[2, 3, 1, 5].item() == 2 * 64 + 1 * 32 + 5 * 4 + 3
    view[1, 2, 0, 7] = -1  # writes through the view land in the same block's bytes
    assert (cache[1] == -1).sum().item() == 1 and (cache[0] >= 0).all() and (cache[2] >= 0).all()


def test_fp8_cache_values_are_finite():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), -1000.0, 1.5, -0.0])
    assert to_cache_dtype(x, torch.float8_e4m3fn).float().tolist() == [0.0, 448.0, -448.0, -448.0, 1.5, 0.0]
    assert to_cache_dtype(x, torch.float32)[0].isnan()  # other caches store what they are given


def make_input_norm(num_tokens, hidden_size, dtype, *, bias_width=None, seed=2):
    """A layer's deferred input norm (`DeferredNorm`): residual stream rows with a row stride, of scales from
    0.1 to 100 (row 0 at 1), so r differs by row and matters; given bias_width, the projection's bias."""
    from nanoinfer.layers.layernorm import DeferredNorm

    gen = torch.Generator().manual_seed(seed)
    scales = 10 ** (3 * torch.rand(num_tokens, 1, generator=gen) - 1)
    scales[0] = 1.0
    hidden = (scales * torch.randn(num_tokens, hidden_size + 3, generator=gen)).to(DEVICE, dtype)[:, :hidden_size]
    bias = None if bias_width is None else torch.randn(bias_width, generator=gen).to(DEVICE, dtype)
    return DeferredNorm(hidden, 1e-6, bias)


def make_qkv_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype, *, qk_norm, seed=1):
    """A fused QKV projection output (with extra columns, so rows are strided), positions,
    and the rotary table and Qwen3 head norms of a small model."""
    from nanoinfer.layers.layernorm import RMSNorm
    from nanoinfer.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width + 5, generator=gen)[:, :width].to(DEVICE, dtype)
    positions = torch.randint(0, 300, (num_tokens,), generator=gen).to(DEVICE)
    rope = RotaryEmbedding(head_dim, 4096, {"rope_theta": 10000.0, "rope_type": "default"}).to(DEVICE)
    norms = (None, None)
    if qk_norm:
        norms = tuple(RMSNorm(head_dim, 1e-6).to(DEVICE, dtype) for _ in range(2))
        for norm in norms:
            norm.weight.data = (1 + 0.5 * torch.randn(head_dim, generator=gen)).to(DEVICE, dtype)
    return qkv, positions, rope, norms


@kernel_test
def test_backend_rotate_cache_then_attend_matches_torch_backend():
    """Full backend path: rotate and cache this step's K/V (padding slot skipped), then attend."""
    backend = triton_backend.TritonAttentionBackend()
    assert backend.name == "triton"
    q_lens, seq_lens = [1, 4, 3], [20, 4, 19]
    _, k_cache, v_cache, md = make_batch(q_lens, seq_lens, 4, 2, 64, torch.float16, extra_rows=1)
    # This step's rows are the last q_len context positions of each sequence.
    slots, positions = [], []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(md.block_tables[i, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
            positions.append(pos)
    md.slot_mapping = torch.tensor(slots + [-1], dtype=torch.int64, device=DEVICE)
    qkv, _, rope, (q_norm, k_norm) = make_qkv_inputs(len(slots) + 1, 4, 2, 64, torch.float16, qk_norm=True)
    positions = torch.tensor(positions + [0], device=DEVICE)
    input_norm = make_input_norm(len(slots) + 1, 96, torch.float16, bias_width=qkv.shape[1])
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_q = TorchAttentionBackend().rotate_and_cache(qkv, positions, rope, q_norm, k_norm, ref_k, ref_v,
                                                     md.slot_mapping, 4, input_norm)
    query = backend.rotate_and_cache(qkv, positions, rope, q_norm, k_norm, k_cache, v_cache, md.slot_mapping, 4,
                                     input_norm)
    torch.testing.assert_close(query, ref_q, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(k_cache.nan_to_num(7.0), ref_k.nan_to_num(7.0), rtol=1e-3, atol=1e-3)
    # V: the deferred norm's rounding (r's last float32 bit may move it one ulp).
    torch.testing.assert_close(v_cache.nan_to_num(7.0), ref_v.nan_to_num(7.0), rtol=2**-10, atol=0.0)
    out = backend.forward(query, k_cache, v_cache, md, 0.125)
    assert rel_err(out, reference(query, k_cache, v_cache, md, 0.125), sum(q_lens)) < REL_TOL[torch.float16]


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
     (torch.bfloat16, torch.float8_e4m3fn)],
)
@pytest.mark.parametrize("qk_norm,bias", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dim_major_v,heads_per_program", [(False, 1), (True, 2), (False, 4), (False, 8)])
@kernel_test
def test_rotate_and_cache_matches_reference_and_skips_padding(dtype, cache_dtype, qk_norm, bias, dim_major_v,
                                                              heads_per_program):
    """Against the PyTorch path (deferred input norm, head norms, rotary, KV write as separate ops): the same
    rounding steps, so within two ulps of the output dtype at the largest value (fused multiply-adds;
    Triton's interpreter truncates float32 -> bf16 where the GPU rounds to nearest, at each of
    the norms' and the rotation's roundings). A wrong angle, sign, head, r or bias is off by O(1): the
    residual rows behind the tokens differ in scale by up to 1000 (`make_input_norm`), 1000 wide.
    An fp8 cache (GPU only): within one fp8 ulp, a K and a V value of +-1000 saturate to +-448
    and a NaN V value is stored as 0, in both paths. V in K's layout or dim-major (`dim_major_view`); one
    to eight heads per program (9 heads: a program may hold query and key heads, or masked rows)."""
    if cache_dtype == torch.float8_e4m3fn and DEVICE == "cpu":
        pytest.skip("Triton's interpreter rounds to fp8 wrongly (a mantissa carry is lost: 1.99 -> 1.0); "
                    "the fp8 store is checked on the GPU, the fp8 loads here (test_fp8_cache_*)")
    num_heads, num_kv_heads, head_dim = 6, 3, 32
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.randn(2, 6, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(DEVICE, cache_dtype)
    if dim_major_v:
        v_cache = dim_major_view(v_cache.contiguous())  # other values, same checks
    qkv, positions, rope, (q_norm, k_norm) = make_qkv_inputs(9, num_heads, num_kv_heads, head_dim, dtype, qk_norm=qk_norm)
    qkv[0, num_heads * head_dim] = 1000.0  # token 0's first K and V values (its r is about 1)
    qkv[0, (num_heads + num_kv_heads) * head_dim] = -1000.0
    fp8 = cache_dtype == torch.float8_e4m3fn
    if fp8:
        qkv[1, (num_heads + num_kv_heads) * head_dim + 1] = float("nan")  # token 1's second V value
    slot_mapping = torch.tensor([0, 17, -1, 15, 16, 95, -1, 40, 63], dtype=torch.int64, device=DEVICE)
    input_norm = make_input_norm(9, 1000, dtype, bias_width=qkv.shape[1] if bias else None)
    ref_k, ref_v, original_k, original_v = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    ref_q = TorchAttentionBackend().rotate_and_cache(qkv, positions, rope, q_norm, k_norm, ref_k, ref_v, slot_mapping,
                                                     num_heads, input_norm)
    weights = (q_norm.weight, k_norm.weight, q_norm.eps) if qk_norm else (None, None, 0.0)
    query = rc.rotate_and_cache(qkv, positions, rope.cos_cache, rope.sin_cache, *weights, k_cache, v_cache, slot_mapping,
                                num_heads, input_norm.hidden, input_norm.eps, input_norm.bias, heads_per_program)
    ulp = {torch.float32: 2**-22, torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float8_e4m3fn: 2**-3}

    def assert_close(out, ref, dtype):
        tol = 2 * ulp[dtype]
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())

    assert_close(query, ref_q, dtype)
    assert_close(k_cache, ref_k, cache_dtype)
    # V: the deferred norm's one rounding (the interpreter's truncation, or r's last float32 bit, may move it
    # one ulp; after a cancelling bias, that bit of the scaled value), then the cache's (fp8: its subnormal step).
    atol = ulp[torch.float32] * ref_v.float().abs().max().item() + (2**-9 if fp8 else 0.0)
    torch.testing.assert_close(v_cache.float(), ref_v.float(), rtol=ulp[cache_dtype], atol=atol)
    if fp8:
        assert v_cache[0, 0, 0, 0].item() == ref_v[0, 0, 0, 0].item() == -448.0  # slot 0
        assert v_cache[1, 1, 0, 1].item() == ref_v[1, 1, 0, 1].item() == 0.0  # slot 17: NaN stored as 0
        assert k_cache.float().abs().max().item() == ref_k.float().abs().max().item() <= 448.0
    # Only the scheduled slots changed; the padding rows (-1) wrote nothing.
    untouched = torch.ones(6 * BLOCK_SIZE, dtype=torch.bool)
    untouched[[0, 17, 15, 16, 95, 40, 63]] = False
    for cache, original in ((k_cache, original_k), (v_cache, original_v)):
        assert torch.equal(cache.flatten(0, 1)[untouched], original.flatten(0, 1)[untouched])


@kernel_test
def test_heads_per_program():
    """A program's heads are one tile: 8, or fewer for a model with fewer heads (a power of two; rows past the
    heads are masked)."""
    assert rc.choose_heads_per_program(24) == rc.choose_heads_per_program(20) == rc.choose_heads_per_program(12) == 8
    assert rc.choose_heads_per_program(6) == 8 and rc.choose_heads_per_program(3) == 4 and rc.choose_heads_per_program(1) == 1
    qkv = torch.zeros(1, 4 * 64)
    cache = torch.zeros(1, BLOCK_SIZE, 1, 64)
    table = torch.zeros(8, 32)
    for bad in (3, -2):
        with pytest.raises(ValueError, match="heads_per_program must be a power of two"):
            rc.rotate_and_cache(qkv, torch.zeros(1, dtype=torch.int64), table, table, None, None, 1e-6, cache, cache,
                                torch.zeros(1, dtype=torch.int64), num_heads=2, hidden=torch.ones(1, 64),
                                hidden_eps=1e-6, heads_per_program=bad)


@kernel_test
def test_choose_config_splits_only_when_sequences_leave_sms_idle():
    def config(num_seqs, max_seq_len, max_query_len=1, cache_dtype=None):
        return ac.choose_config(
            num_heads=16, num_kv_heads=8, dtype=torch.bfloat16, max_query_len=max_query_len,
            num_seqs=num_seqs, max_seq_len=max_seq_len, num_sms=132, cache_dtype=cache_dtype,
        )

    one_long = config(1, 2000)
    assert one_long.decode and one_long.num_splits == 32
    assert config(1, 500).num_splits == 8  # one BLOCK_N (64) step per split at least
    assert config(1, 64).num_splits == 1  # a single step: nothing to split
    assert config(16, 2000).num_splits == 16  # 128 programs: 2 x 8 x 132 // 128
    assert config(64, 2000).num_splits == 4  # 512 programs: 4.1
    assert config(256, 2000).num_splits == 1  # 2048 programs fill the GPU
    assert config(1, 100_000).num_splits == 32
    prefill = config(4, 2000, max_query_len=300)
    assert not prefill.decode and prefill.num_splits == 1
    assert prefill.block_q * 2 <= prefill.block_m <= 128
    assert config(4, 2000, max_query_len=5).block_m == 16  # short chunks get short tiles
    # An fp8 cache, unsplit: 128-token steps while the grid fits the SMs at 4 programs each (528 on 132
    # SMs), beyond that 64-token steps under a register cap (more resident programs); split, and bf16: 64, no cap.
    fp8 = torch.float8_e4m3fn
    # Split, balanced over 8 programs per SM: the fp8 kernel's register cap (uncapped it holds 4 per SM).
    assert config(64, 2000, cache_dtype=fp8).block_n == 64 and config(64, 2000).block_n == 64
    assert config(64, 2000, cache_dtype=fp8).max_registers == 128 and config(64, 2000).max_registers is None
    assert (config(100, 2000, cache_dtype=fp8).num_splits, config(100, 2000, cache_dtype=fp8).max_registers) == (2, 128)
    # Unsplit with more than 4 programs per SM: the fp8 kernel's 64-token steps under the cap; up to 4, 128.
    wide = config(256, 2000, cache_dtype=fp8)
    assert (wide.block_n, wide.max_registers) == (64, 128) and config(256, 2000).max_registers is None
    assert (config(64, 50, cache_dtype=fp8).num_splits, config(64, 50, cache_dtype=fp8).block_n) == (1, 128)


@kernel_test
def test_balanced_splits_size_mid_batches_over_the_launch():
    """8 programs per SM over the launch's total context, and a grid with enough splits for a sequence twice
    the mean context: 100 sequences (800 programs) on 132 SMs get 2 splits (2 x 8 x 132 // 800 = 2), each at
    least total context x 8 KV heads / 1056 programs long; 256 sequences none (and no balance)."""
    def config(num_seqs):
        return ac.choose_config(num_heads=16, num_kv_heads=8, dtype=torch.bfloat16, max_query_len=1,
                                num_seqs=num_seqs, max_seq_len=2048, num_sms=132, cache_dtype=torch.float8_e4m3fn)

    assert (config(100).num_splits, config(100).balance_programs) == (2, 8 * 132)
    assert (config(256).num_splits, config(256).balance_programs, config(256).max_registers) == (1, 0, 128)
    assert config(16).num_splits == 16 and config(1).num_splits == 32


@kernel_test
def test_bad_inputs_raise_clear_errors():
    query, k_cache, v_cache, md = make_batch([1, 1], [5, 9], 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="head_dim"):
        run_kernel(query[..., :48], k_cache[..., :48], v_cache[..., :48], md, 0.1)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        run_kernel(query[:, :3], k_cache, v_cache, md, 0.1)
    with pytest.raises(ValueError, match="max_query_len"):
        _, _, _, prefill_md = make_batch([3, 1], [5, 9], 4, 2, 64, torch.float32)
        decode_config = ac.choose_config(
            num_heads=4, num_kv_heads=2, dtype=torch.float32, max_query_len=1, num_seqs=2, max_seq_len=9, num_sms=1
        )
        pa.paged_attention(
            query, k_cache, v_cache, prefill_md.query_start_loc, prefill_md.seq_lens, prefill_md.block_tables, 0.1,
            max_query_len=3, config=decode_config,
        )
    md.block_tables = md.block_tables.long()
    with pytest.raises(TypeError, match="block_tables must be int32"):
        run_kernel(query, k_cache, v_cache, md, 0.1)
    qkv = torch.zeros(2, 8 * 64, device=DEVICE)
    cos = torch.zeros(16, 32, device=DEVICE)
    positions = torch.zeros(2, dtype=torch.long, device=DEVICE)
    hidden = torch.ones(2, 96, device=DEVICE)

    def rotate(qkv=qkv, cos=cos, slot_mapping=md.slot_mapping, hidden=hidden, qkv_bias=None):
        return rc.rotate_and_cache(qkv, positions, cos, cos, None, None, 0.0, k_cache, v_cache, slot_mapping, 4, hidden,
                                   1e-6, qkv_bias)

    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        rotate(slot_mapping=md.slot_mapping.int())
    with pytest.raises(ValueError, match=r"qkv must be \[num_tokens"):
        rotate(qkv=qkv[:, :-64])
    with pytest.raises(ValueError, match="cos/sin tables"):
        rotate(cos=cos[:, :16])
    strided = torch.ones(96, 2, device=DEVICE).t()
    for bad_hidden in (hidden[:1], hidden.half(), strided, hidden[:, :0]):
        with pytest.raises(ValueError, match=r"hidden must be \[2, hidden_size\] in qkv's dtype"):
            rotate(hidden=bad_hidden)
    for bad_bias in (torch.ones(8 * 64 - 1, device=DEVICE), torch.ones(8 * 64, 2, device=DEVICE)[:, 0]):
        with pytest.raises(ValueError, match=r"qkv_bias must be None or a contiguous \[512\]"):
            rotate(qkv_bias=bad_bias)
