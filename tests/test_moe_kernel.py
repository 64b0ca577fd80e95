"""The fused MoE Triton kernel (kernels/moe.py) against the PyTorch math it replaces (layers/moe.py's
`fused_moe_math`), its routing layout (`moe_align`), its launch heuristic and its input checks.

Kernel launches (`moe_align`'s too) run in Triton's interpreter on CPU, in a child pytest (tests/triton_child.py);
the heuristic and the input checks also run in the parent. One GPU-only test captures the whole call in a CUDA
graph at Qwen3-30B-A3B's shape and replays it with new routings.

Tolerances, against `fused_moe_math` on the same (rounded) inputs: the math rounds gate/up, silu(gate) and each
expert's output to x's dtype where the kernel keeps float32 (both round silu(gate) * up, the intermediate), so
16-bit results differ by a few ulp of the intermediate and output.
Measured over random inputs: ||out - ref|| / ||ref|| <= 3e-7 (fp32), 7e-4 (fp16), 6e-3 (bf16; the interpreter
truncates to bf16 where the GPU rounds), and the kernel is the closer of the two to a float64 reference. Bounds
(REL_TOL, and elementwise ELEM_TOL relative to the output's scale) leave a few times headroom; a wrong row,
expert, column tile or routing weight is off by O(1).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from triton_child import interpreter_child, kernel_test

from nanoinfer.kernels import moe as km
from nanoinfer.layers import moe as layer
from nanoinfer.layers.moe import fused_moe_math

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REL_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
ELEM_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}

test_cpu_interpreter_child = interpreter_child(__file__)


def make_experts(T: int, H: int, I: int, E: int, dtype: torch.dtype, seed: int = 0):
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], scaled so every stage is O(1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(DEVICE, dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(DEVICE, dtype)
    return x, w13, w2


def make_routing(T: int, E: int, k: int, seed: int = 0):
    """Each token's top-k of random router logits: (weights [T, k] float32, ids [T, k] int32), no repeats."""
    g = torch.Generator().manual_seed(seed + 1000)
    return layer.route(torch.randn(T, E, generator=g).to(DEVICE), k, renormalize=False)


def check_kernel(x, w13, w2, weights, ids, w13_scale=None, w2_scale=None) -> None:
    out = km.fused_moe(x, w13, w2, weights, ids, None, w13_scale, w2_scale)
    ref = fused_moe_math(x, w13, w2, weights, ids, w13_scale, w2_scale)
    assert out.shape == ref.shape and out.dtype == x.dtype and out.device == x.device
    dtype = x.dtype
    out64, ref64 = out.double(), ref.double()
    assert torch.isfinite(out64).all()
    assert ((out64 - ref64).norm() / ref64.norm()).item() < REL_TOL[dtype]
    elem = ELEM_TOL[dtype]
    torch.testing.assert_close(out64, ref64, rtol=elem, atol=elem * ref64.abs().max().item())


# ----- the kernel (interpreter child on CPU) -----


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,I,E,k", [(1, 40, 24, 4, 1), (3, 40, 24, 8, 2), (17, 96, 48, 8, 4), (64, 40, 24, 4, 2)])
def test_kernel_matches_math(dtype, T, H, I, E, k) -> None:
    """H = 40 / 96 and I = 24 / 48 are no multiples of the tiles (masked N and K edges). T = 17, k = 4 gives
    12 row blocks (a partial group of 8); T = 64, k = 2 over 4 experts gives 32-row blocks (prefill's tiles)."""
    x, w13, w2 = make_experts(T, H, I, E, dtype, seed=T)
    weights, ids = make_routing(T, E, k, seed=T)
    check_kernel(x, w13, w2, weights, ids)


def assert_rows_match_math(out, x, q13, q2, weights, ids, s13, s2, rows: list[int]) -> None:
    """Each of these rows of `out` = the math on it, within x's dtype's tolerances relative to that row's own
    scale (rows of very different magnitudes are checked one by one)."""
    for row in rows:
        ref = fused_moe_math(x[row:row + 1], q13, q2, weights[row:row + 1], ids[row:row + 1], s13, s2).double()
        got = out[row:row + 1].double()
        assert ((got - ref).norm() / ref.norm()).item() < REL_TOL[x.dtype], row
        torch.testing.assert_close(got, ref, rtol=ELEM_TOL[x.dtype], atol=ELEM_TOL[x.dtype] * ref.abs().max().item(),
                                   msg=lambda m, row=row: f"row {row}: {m}")


@kernel_test
def test_fp8_experts_in_bf16_keep_their_range_in_float16() -> None:
    """A bfloat16 x multiplies fp8 experts in float16 (x converted once, here with strided rows; the intermediate
    stored times 2^-4): a token of x ~ 0.1, one of x ~ 0.02 (its intermediate ~1e-4, stored as float16
    subnormals: on a GPU this checks that the tensor cores keep them) and one whose intermediate passes float16's
    65504 (~1e5) equal the math; a token whose x passes 65504 saturates (its output stays finite); an inf in x
    stays inf (the output is not finite, as the math's); the other tokens are untouched."""
    T, H, I, E, k = 7, 96, 48, 8, 4
    x, w13, w2 = make_experts(T, H + 16, I, E, torch.bfloat16, seed=7)
    x, w13, w2 = x[:, :H], w13[:, :, :H].contiguous(), w2[:, :H].contiguous()
    x[1] *= 0.1
    x[2] *= 300
    x[3] *= 3e5
    x[4, 5] = float("inf")
    x[6] *= 0.02
    q13, s13, q2, s2 = quantized_experts(w13, w2)
    weights, ids = make_routing(T, E, k, seed=7)
    out = km.fused_moe(x, q13, q2, weights, ids, None, s13, s2)
    gate_up = torch.einsum("h,nh->n", x[2].float(), (q13[ids[2, 0]].float() * s13[ids[2, 0], :, None]))
    assert (torch.nn.functional.silu(gate_up[:I]) * gate_up[I:]).abs().max() > 65504  # the intermediate's range
    assert_rows_match_math(out, x, q13, q2, weights, ids, s13, s2, [0, 1, 2, 5, 6])
    assert x.stride(0) == H + 16 and torch.isfinite(out[3].float()).all() and out[3].abs().max() > 1e3
    assert not torch.isfinite(out[4].float()).all()
    assert not torch.isfinite(fused_moe_math(x[4:5], q13, q2, weights[4:5], ids[4:5], s13, s2).float()).all()


@kernel_test
def test_fp8_experts_in_fp16_are_not_saturated() -> None:
    """A float16 model's intermediate is x's dtype, unscaled: one past 65504 overflows as the math's does (the
    saturation is the bf16 path's alone), and the other tokens are untouched."""
    T, H, I, E, k = 4, 96, 48, 8, 4
    x, w13, w2 = make_experts(T, H, I, E, torch.float16, seed=7)
    x[2] *= 300
    q13, s13, q2, s2 = quantized_experts(w13, w2)
    weights, ids = make_routing(T, E, k, seed=7)
    out = km.fused_moe(x, q13, q2, weights, ids, None, s13, s2)
    assert not torch.isfinite(out[2].float()).all()
    assert not torch.isfinite(fused_moe_math(x[2:3], q13, q2, weights[2:3], ids[2:3], s13, s2).float()).all()
    assert_rows_match_math(out, x, q13, q2, weights, ids, s13, s2, [0, 1, 3])


@kernel_test
def test_fp8_experts_in_bf16_wide_rows_with_residual() -> None:
    """H = 1100: x's float16 copy in two column blocks of 1024; the sum added into the residual stream."""
    T, H, I, E, k = 3, 1100, 40, 4, 2
    x, w13, w2 = make_experts(T, H, I, E, torch.bfloat16, seed=9)
    q13, s13, q2, s2 = quantized_experts(w13, w2)
    weights, ids = make_routing(T, E, k, seed=9)
    residual = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    expected = residual.double() + fused_moe_math(x, q13, q2, weights, ids, s13, s2).double()
    out = km.fused_moe(x, q13, q2, weights, ids, residual, s13, s2)
    assert out.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(out.double(), expected, rtol=ELEM_TOL[torch.bfloat16],
                               atol=ELEM_TOL[torch.bfloat16] * expected.abs().max().item())


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_without_tokens_and_one_expert_for_all(dtype) -> None:
    """Routings the softmax rarely draws: experts 4..7 of 8 get nothing; every token's first choice is expert
    5 (one expert over several 16-row blocks, 33 rows: a partial last block); int64 ids."""
    x, w13, w2 = make_experts(33, 40, 24, 8, dtype, seed=1)
    g = torch.Generator().manual_seed(1)
    weights = torch.rand(33, 2, generator=g).to(DEVICE)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(33)]).to(DEVICE)  # experts 0..3 only
    check_kernel(x, w13, w2, weights, ids)
    ids[:, 0] = 5
    check_kernel(x, w13, w2, weights, ids.to(torch.int32))
    check_kernel(x[:16], w13, w2, weights[:16, :1], ids[:16, :1].to(torch.int32))  # k = 1, all on expert 5


@kernel_test
def test_block_sizes_and_determinism(monkeypatch) -> None:
    """Forced 32- and 64-row blocks (prefill's tiles at a decode-sized batch: mostly padding rows) give the same
    result as 16-row ones, and a repeated call gives the same bits."""
    x, w13, w2 = make_experts(17, 40, 24, 8, torch.float32, seed=2)
    weights, ids = make_routing(17, 8, 2, seed=2)
    ref = fused_moe_math(x, w13, w2, weights, ids)
    first = km.fused_moe(x, w13, w2, weights, ids)
    assert torch.equal(first, km.fused_moe(x, w13, w2, weights, ids))
    for block_m in (32, 64):
        monkeypatch.setattr(km, "choose_block_m", lambda num_entries, num_experts, block_m=block_m: block_m)
        torch.testing.assert_close(km.fused_moe(x, w13, w2, weights, ids), ref, rtol=1e-5, atol=1e-5)


@kernel_test
def test_layer_dispatches_to_kernel(monkeypatch) -> None:
    """layers/moe.py's `fused_moe` runs the kernel where `_kernel_device` says so, and the math elsewhere."""
    x, w13, w2 = make_experts(5, 40, 24, 4, torch.float32, seed=3)
    weights, ids = make_routing(5, 4, 2, seed=3)
    calls = []
    real = km.fused_moe
    monkeypatch.setattr(km, "fused_moe", lambda *a: calls.append(a[0].shape) or real(*a))
    monkeypatch.setattr(layer, "_kernel_device", lambda x: True)
    torch.testing.assert_close(layer.fused_moe(x, w13, w2, weights, ids), fused_moe_math(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)
    assert calls == [(5, 40)]
    layer.fused_moe(x.double(), w13.double(), w2.double(), weights, ids)  # unsupported dtype: the math
    assert calls == [(5, 40)]


def quantized_experts(w13: torch.Tensor, w2: torch.Tensor):
    """Each expert's rows to float8_e4m3fn with a float32 scale per row (`quantization="fp8"`'s scheme):
    (w13, its scales, w2, its scales)."""
    return [*layer.quantize_experts(w13), *layer.quantize_experts(w2)]


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,I,E,k", [(1, 40, 24, 4, 2), (17, 96, 48, 8, 4)])
def test_fp8_weights_match_math(dtype, T, H, I, E, k) -> None:
    """fp8 weights converted as loaded (to x's dtype, or float16 for a bfloat16 x) and scaled per row in the
    epilogue = the math on the dequantized weights (`fused_moe_math` with the scales)."""
    x, w13, w2 = make_experts(T, H, I, E, dtype, seed=5)
    q13, s13, q2, s2 = quantized_experts(w13, w2)
    weights, ids = make_routing(T, E, k, seed=5)
    check_kernel(x, q13, q2, weights, ids, s13, s2)
    assert km.supports(x, q13, q2, s13, s2) and not km.supports(x, q13, q2) and not km.supports(x, q13, q2, s13)


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_gets_the_sum_added_in_place(dtype) -> None:
    """With `residual`, the last kernel adds the k rows and the residual row in float32 and rounds once."""
    x, w13, w2 = make_experts(9, 40, 24, 8, dtype, seed=4)
    weights, ids = make_routing(9, 8, 2, seed=4)
    residual = torch.randn(9, 40, dtype=dtype, device=DEVICE)
    expected = (residual.float() + fused_moe_math(x, w13, w2, weights, ids).float()).to(dtype)
    out = km.fused_moe(x, w13, w2, weights, ids, residual=residual)
    assert out is residual
    torch.testing.assert_close(out.float(), expected.float(), rtol=ELEM_TOL[dtype], atol=ELEM_TOL[dtype] * 4)
    with pytest.raises(ValueError, match="residual"):
        km.fused_moe(x, w13, w2, weights, ids, residual=residual[:, :20])


# ----- routing: softmax and top-k (interpreter child on CPU) -----


@kernel_test
@pytest.mark.parametrize("T,E,k", [(1, 4, 1), (7, 8, 2), (33, 60, 8), (5, 128, 8)])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_softmax_equals_route(T, E, k, renormalize, dtype) -> None:
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T * E + k)).to(dtype).to(DEVICE)
    weights, ids = km.topk_softmax(logits, k, renormalize)
    expected_weights, expected_ids = layer.route(logits, k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)
    if dtype == torch.float32:
        assert torch.equal(ids, expected_ids)
    else:  # bf16 logits tie: then any of the equal experts is right (torch.topk's choice among them is its own)
        probs = torch.softmax(logits.float(), dim=-1)
        assert all(len(set(row)) == k for row in ids.tolist())  # k different experts per token
        torch.testing.assert_close(probs.gather(1, ids.long()), probs.gather(1, expected_ids.long()), rtol=0, atol=0)


@kernel_test
@pytest.mark.parametrize("E", [6, 8, 128])
def test_topk_softmax_ties_and_nan(E) -> None:
    """Equal probabilities go lowest-numbered expert first, in the kernel and in `route` alike (torch.topk's order
    among ties is its own, and differs between devices); a row with a NaN or inf logit gets NaN weights and still
    names experts in range, so the GEMMs never read outside the weights; the other rows are untouched."""
    ties = torch.zeros(2, E, device=DEVICE)
    ties[1, E // 2:] = 1.0  # the upper half ties for first place
    weights, ids = km.topk_softmax(ties, 3, False)
    expected_weights, expected_ids = layer.route(ties, 3, False)
    assert ids.tolist() == expected_ids.tolist() == [[0, 1, 2], [E // 2, E // 2 + 1, E // 2 + 2]]
    torch.testing.assert_close(weights, expected_weights)
    logits = torch.randn(4, E, generator=torch.Generator().manual_seed(E)).to(DEVICE)
    logits[1, 2] = float("nan")
    logits[2, 0] = float("inf")
    weights, ids = km.topk_softmax(logits, 4, True)
    assert ((ids >= 0) & (ids < E)).all() and weights[1:3].isnan().all()
    expected_weights, expected_ids = layer.route(logits[[0, 3]], 4, True)
    assert torch.equal(ids[[0, 3]], expected_ids)
    torch.testing.assert_close(weights[[0, 3]], expected_weights)
    with pytest.raises(ValueError, match="1 <= top_k <= E"):
        km.topk_softmax(logits, E + 1, True)


@kernel_test
def test_layer_selects_experts_with_the_kernel(monkeypatch) -> None:
    logits = torch.randn(4, 8, device=DEVICE)
    monkeypatch.setattr(layer, "_kernel_device", lambda x: True)
    calls = []
    real = km.topk_softmax
    monkeypatch.setattr(km, "topk_softmax", lambda *a: calls.append(a[0].shape) or real(*a))
    weights, ids = layer.select_experts(logits, 2, True)
    assert calls == [(4, 8)] and torch.equal(ids, layer.route(logits, 2, True)[1])


# ----- the routing layout (interpreter child on CPU) -----


def check_align(ids: torch.Tensor, E: int, block_m: int) -> None:
    """Every entry once, in order within its expert; padding entries = T * k; each used block's entries
    belong to its expert; the used length is each expert's count rounded up to block_m, summed."""
    sorted_ids, block_expert, num_padded = km.moe_align(ids, E, block_m)
    n = ids.numel()
    size = km.padded_size(n, E, block_m)
    assert sorted_ids.shape == (size,) and block_expert.shape == (size // block_m,) and num_padded.shape == (1,)
    assert sorted_ids.dtype == block_expert.dtype == num_padded.dtype == torch.int32
    flat, sorted_ids, block_expert = ids.reshape(-1).long().cpu(), sorted_ids.long().cpu(), block_expert.long().cpu()
    counts = torch.bincount(flat, minlength=E)
    used = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert int(num_padded) == used <= size
    assert (sorted_ids[used:] == n).all()
    real = sorted_ids[sorted_ids < n]
    assert torch.equal(real.sort().values, torch.arange(n)) and (sorted_ids <= n).all()
    for b in range(used // block_m):
        block = sorted_ids[b * block_m:(b + 1) * block_m]
        entries = block[block < n]
        assert len(entries) > 0 and (flat[entries] == block_expert[b]).all()
        assert (block[len(entries):] == n).all()  # padding at the end of the expert's run
    for e in range(E):
        mine = real[flat[real] == e]
        assert torch.equal(mine, (flat == e).nonzero().flatten())  # stable: token order kept


@kernel_test
@pytest.mark.parametrize("T,k,E,block_m", [(1, 1, 4, 16), (3, 2, 8, 16), (17, 4, 8, 16), (64, 2, 4, 16),
                                           (64, 4, 8, 64), (40, 8, 128, 16), (200, 2, 8, 32), (5, 3, 200, 16),
                                           (8, 8, 128, 16)])
def test_moe_align_random_routing(T, k, E, block_m) -> None:
    """Random top-k routings, most with empty experts; 40 x 8 entries over 128 experts are 10 chunks of 32 (the
    entries of earlier chunks count towards a chunk's positions); 200 experts pad to 256 (16-entry steps); up to
    64 entries (1 x 1, 3 x 2, 5 x 3, 8 x 8) in one launch."""
    _, ids = make_routing(T, E, k, seed=T * E)
    check_align(ids, E, block_m)


@kernel_test
@pytest.mark.parametrize("step,programs,one_launch", [(16, 3, 0), (16, 128, 0), (16, 3, 64)],
                         ids=["multi_step_chunks", "one_step_chunks", "one_launch"])
def test_moe_align_empty_and_crowded_experts(monkeypatch, step, programs, one_launch) -> None:
    """Experts with no entries at the start, middle and end; one expert taking every token; runs of exactly
    block_m entries (no padding) and of block_m + 1; no entries. With 16-entry steps, in chunks (and slices of
    the layout) of several steps or of one; or, up to 64 entries (all of these), in one launch whose programs
    count the entries themselves (the count kernel is never launched)."""
    monkeypatch.setattr(km, "_ALIGN_MAX_STEP", step)
    monkeypatch.setattr(km, "_ALIGN_PROGRAMS", programs)
    monkeypatch.setattr(km, "_ALIGN_ONE_LAUNCH_ENTRIES", one_launch)
    if one_launch:
        monkeypatch.setattr(km, "_count_kernel", None)
    g = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.randperm(3, generator=g)[:2] + 2 for _ in range(30)]).to(DEVICE)  # experts 2..4 of 8
    check_align(ids, 8, 16)
    check_align(torch.full((33, 1), 6, dtype=torch.int32, device=DEVICE), 8, 16)
    check_align(torch.full((32, 1), 0, dtype=torch.int32, device=DEVICE), 4, 16)
    check_align(torch.arange(64, device=DEVICE).reshape(32, 2) % 4, 4, 16)  # 16 entries per expert
    sorted_ids, block_expert, num_padded = km.moe_align(torch.zeros(0, 2, dtype=torch.int32, device=DEVICE), 4, 16)
    assert sorted_ids.numel() == block_expert.numel() == 0 and num_padded.tolist() == [0]


# ----- heuristic, input checks (no launch: run in the parent too) -----


def test_padded_size_bounds_any_routing() -> None:
    """The static length covers the worst routing: every expert in use with one entry past a whole block."""
    for n, E, block_m in ((8, 128, 16), (17, 8, 16), (2048, 128, 16), (65536, 128, 64), (1, 4, 64)):
        worst = min(n, E) * (block_m - 1) + n
        assert km.padded_size(n, E, block_m) >= worst and km.padded_size(n, E, block_m) % block_m == 0
    assert km.padded_size(8, 128, 16) == 128  # decode at k = 8: 8 blocks, not 128 experts' worth


def test_launch_heuristic() -> None:
    """16-row blocks at decode (Qwen3-30B-A3B: 128 experts, k = 8, up to 256 tokens), 64 at prefill; tiles are
    powers of two >= 16 (tl.dot) no larger than the problem needs."""
    assert [km.choose_block_m(T * 8, 128) for T in (1, 64, 256, 512, 1024, 8192)] == [16, 16, 16, 32, 64, 64]
    for block_m in (16, 32, 64):
        for N, K, gated in ((768, 2048, True), (2048, 768, False), (24, 40, True), (40, 24, False), (1, 1, False)):
            c = km.choose_config(block_m, N, K, gated)
            for block in (c.block_n, c.block_k):
                assert block >= 16 and block & (block - 1) == 0
            assert c.block_n <= max(16, 2 * N) and c.block_k <= max(16, 2 * K)
            assert c.num_warps in (2, 4, 8) and 2 <= c.num_stages <= 5
            fp8 = km.choose_config(block_m, N, K, gated, fp8=True)  # narrower plain tiles at decode only
            assert fp8 == (dataclasses.replace(c, block_n=min(c.block_n, 64)) if block_m <= 16 and not gated else c)


def test_supports() -> None:
    x, w13, w2 = make_experts(4, 40, 24, 4, torch.float32)
    assert km.supports(x, w13, w2)
    assert km.supports(x.half(), w13.half(), w2.half()) and km.supports(x.bfloat16(), w13.bfloat16(), w2.bfloat16())
    assert km.supports(torch.randn(4, 48, device=DEVICE)[:, :40], w13, w2)  # strided rows
    assert not km.supports(x.double(), w13.double(), w2.double())  # dtype
    assert not km.supports(x, w13.half(), w2)  # mixed dtypes
    assert not km.supports(x[None], w13, w2)  # 3-D x
    assert not km.supports(x[:, :32], w13, w2)  # hidden size
    assert not km.supports(x, w13[:, :47], w2)  # odd 2I
    assert not km.supports(x, w13, w2[:, :, :20])  # I of w2 != half of w13's rows
    assert not km.supports(x, w13, w2[:3])  # expert counts
    assert not km.supports(x.t().contiguous().t(), w13, w2)  # no unit last stride
    assert not km.supports(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2)


def test_empty_batch_launches_nothing() -> None:
    x, w13, w2 = make_experts(0, 40, 24, 4, torch.bfloat16)
    weights, ids = make_routing(0, 4, 2)
    out = km.fused_moe(x, w13, w2, weights, ids)
    assert out.shape == (0, 40) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("what,match", [
    ("x_dtype", "unsupported x"), ("w2_shape", "unsupported x"), ("weights_shape", r"topk_weights \(3, 3\)"),
    ("ids_rows", r"topk_ids \(4, 2\)"), ("ids_1d", r"topk_ids \(3,\)"), ("k_above_e", "1 <= k <= E = 4"),
    ("ids_float", "topk_ids must be int32/int64"),
])
def test_bad_inputs_raise(what, match) -> None:
    x, w13, w2 = make_experts(3, 40, 24, 4, torch.float32)
    weights, ids = make_routing(3, 4, 2)
    if what == "x_dtype":
        x = x.double()
    elif what == "w2_shape":
        w2 = w2[:, :, :12]
    elif what == "weights_shape":
        weights = torch.ones(3, 3, device=DEVICE)
    elif what == "ids_rows":
        ids = torch.zeros(4, 2, dtype=torch.int32, device=DEVICE)
    elif what == "ids_1d":
        ids, weights = ids[:, 0], weights[:, 0]
    elif what == "k_above_e":
        ids, weights = torch.zeros(3, 5, dtype=torch.int32, device=DEVICE), torch.ones(3, 5, device=DEVICE)
    elif what == "ids_float":
        ids = ids.float()
    with pytest.raises(ValueError, match=match):
        km.fused_moe(x, w13, w2, weights, ids)


# ----- GPU only -----


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_graph_replays_new_routings_at_qwen3_30b_a3b_shape(fp8: bool) -> None:
    """Qwen3-30B-A3B's experts (H = 2048, I = 768, E = 128, k = 8, bf16; or fp8 with row scales) at T = 8,
    captured once in a CUDA graph (the routing layout included: no host synchronisation) and replayed with new
    inputs and routings copied into the captured tensors; each replay matches the math."""
    T, H, I, E, k = 8, 2048, 768, 128, 8
    x, w13, w2 = make_experts(T, H, I, E, torch.bfloat16, seed=5)
    scales = (None, None)
    if fp8:
        w13, scale13, w2, scale2 = quantized_experts(w13, w2)
        scales = (scale13, scale2)
    weights, ids = make_routing(T, E, k, seed=5)
    check_kernel(x, w13, w2, weights, ids, *scales)  # eager: compiles the kernels before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = km.fused_moe(x, w13, w2, weights, ids, None, *scales)
    for seed in (6, 7, 8):
        new_x, _, _ = make_experts(T, H, 1, 1, torch.bfloat16, seed=seed)
        new_weights, new_ids = make_routing(T, E, k, seed=seed)
        if seed == 8:  # every token to the same k experts
            new_ids = torch.arange(3, 3 + k, dtype=torch.int32, device=DEVICE).repeat(T, 1)
        x.copy_(new_x)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        ref = fused_moe_math(x, w13, w2, weights, ids, *scales)
        assert ((out.double() - ref.double()).norm() / ref.double().norm()).item() < REL_TOL[torch.bfloat16]
        torch.testing.assert_close(out.double(), ref.double(), rtol=ELEM_TOL[torch.bfloat16],
                                   atol=ELEM_TOL[torch.bfloat16] * ref.double().abs().max().item())
