"""The skinny (M <= 16) Triton matmul against a float reference, its launch
heuristic, and the `linear` dispatcher the model's linear layers call.

Kernel launches run in Triton's interpreter on CPU, in a child pytest
(tests/triton_child.py). The heuristic and dispatcher tests that launch nothing also run
in the parent.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from triton_child import interpreter_child, kernel_test
import torch.nn.functional as F

from nanoinfer.kernels import arrival_counters
from nanoinfer.kernels import skinny_gemm as sg
from nanoinfer.layers import skinny_dispatch as dispatch
from nanoinfer.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from nanoinfer.layers.moe import Router

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# ||out - ref|| / ||ref|| against the fp32 product of the same (rounded) inputs. The kernel
# accumulates in fp32, so the error is the output's final rounding: fp32 ~1e-7, fp16 ~2e-4,
# bf16 ~3e-3 (the interpreter truncates fp32 -> bf16; the GPU rounds to nearest). Bounds
# leave a few times headroom; a wrong tile, mask or split is off by O(1).
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
QWEN3_06B = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
QWEN3_8B_TP2 = {"qkv": (3072, 4096), "o_proj": (4096, 2048), "gate_up": (12288, 4096), "down": (4096, 6144)}


test_cpu_interpreter_child = interpreter_child(__file__)


def rel_err(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            residual: torch.Tensor | None = None) -> float:
    """Against the float64 product of the same (rounded) inputs, plus bias and residual."""
    ref = x.double() @ weight.double().T
    for term in (bias, residual):
        if term is not None:
            ref = ref + term.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


def make(M: int, N: int, K: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(DEVICE, dtype)
    b = torch.randn(N, generator=gen).to(DEVICE, dtype) if bias else None
    return x, w, b


def split_config(split_k: int, block_n: int = 16, block_k: int = 64) -> sg.SkinnyConfig:
    return sg.SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=2)


# ----- the kernel (interpreter child on CPU) -----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K", [(1, 72, 200), (3, 72, 200), (8, 64, 256), (16, 72, 200)])
@pytest.mark.parametrize("bias", [False, True])
@kernel_test
def test_matches_reference_default_config(M, N, K, dtype, bias):
    """N=72, K=200 are no multiples of any block; 64 x 256 is the power-of-two case."""
    x, w, b = make(M, N, K, dtype, bias)
    out = sg.skinny_linear(x, w, b)
    assert out.shape == (M, N) and out.dtype == dtype and out.device == x.device
    assert rel_err(out, x, w, b) < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "config",
    [split_config(2), split_config(3, block_n=32), split_config(4, block_k=32), split_config(8, block_k=16)],
    ids=lambda c: f"n{c.block_n}k{c.block_k}s{c.split_k}",
)
@kernel_test
def test_split_k_matches_reference_and_leaves_counters_zero(config, dtype):
    """Split-K: the last program of each column tile sums the partials. Uneven splits (K=200
    over 3 or 8 ranges of whole steps, some shorter) and a ragged last column tile (N=72).
    The arrival counters are back at zero afterwards, so a second launch (or a CUDA-graph
    replay) gets the same answer."""
    x, w, b = make(5, 72, 200, dtype, bias=True)
    first = sg.skinny_linear(x, w, b, config=config)
    assert rel_err(first, x, w, b) < REL_TOL[dtype]
    assert int(arrival_counters(x.device, 1).abs().sum()) == 0
    second = sg.skinny_linear(x, w, b, config=config)
    assert torch.equal(first, second)  # the split order of the sum is fixed
    no_split = sg.skinny_linear(x, w, b, config=split_config(1, block_n=config.block_n, block_k=config.block_k))
    assert rel_err(no_split, x, w, b) < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 7, 16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", [split_config(1), split_config(4, block_k=32)], ids=lambda c: f"s{c.split_k}")
@kernel_test
def test_residual_added_in_place(config, M, dtype, bias):
    """With a residual the kernel returns residual + x @ W^T + b, rounded once, in the residual
    itself: here a view into a wider buffer (row stride > N) whose other columns stay as they were.
    Split-K (K=200 over 4 ranges): the last-arriving program adds it."""
    N, K = 72, 200
    x, w, b = make(M, N, K, dtype, bias)
    buffer = torch.randn(M, N + 8, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    before = buffer.clone()
    residual = buffer[:, 4 : N + 4]
    out = sg.skinny_linear(x, w, b, residual=residual, config=config)
    assert out is residual
    assert rel_err(out, x, w, b, before[:, 4 : N + 4]) < REL_TOL[dtype]
    assert torch.equal(buffer[:, :4], before[:, :4]) and torch.equal(buffer[:, N + 4 :], before[:, N + 4 :])
    assert int(arrival_counters(x.device, 1).abs().sum()) == 0


@kernel_test
def test_non_contiguous_inputs():
    """x as a transposed view and as a column slice, weight as a slice of a wider matrix
    (strides are kernel arguments, so views need no copy)."""
    gen = torch.Generator().manual_seed(3)
    M, N, K = 4, 40, 96
    x_t = torch.randn(K, M, generator=gen).to(DEVICE).t()  # strides (1, M)
    x_slice = torch.randn(M, 2 * K, generator=gen).to(DEVICE)[:, ::2]  # strides (2K, 2)
    w_slice = torch.randn(N, K + 8, generator=gen).to(DEVICE)[:, 4 : K + 4]  # row stride K + 8
    for x in (x_t, x_slice):
        assert not x.is_contiguous()
        for w in (w_slice, w_slice.contiguous()):
            for config in (None, split_config(2, block_k=32)):
                out = sg.skinny_linear(x, w, config=config)
                assert rel_err(out, x, w, None) < REL_TOL[torch.float32]


@kernel_test
def test_dispatcher_runs_skinny_when_chosen(monkeypatch):
    """Forced on (the CPU interpreter stands in for the GPU): the layers' forward goes
    through the kernel for a chosen shape and bucket, and matches F.linear; the row-parallel
    layer adds into the residual in place."""
    monkeypatch.setattr(dispatch, "_kernel_device", lambda x: True)
    monkeypatch.setattr(dispatch, "_enabled", True)
    calls = []
    real = sg.skinny_linear
    monkeypatch.setattr(sg, "skinny_linear", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    torch.manual_seed(0)
    col = MergedColumnParallelLinear(64, [48, 48], bias=True).to(DEVICE)
    row = RowParallelLinear(96, 64, bias=True).to(DEVICE)
    for layer in (col, row):
        layer.weight.data.normal_()
        layer.bias.data.normal_()
    monkeypatch.setitem(dispatch._choices, (4, 96, 64, torch.float32), split_config(1))  # M bucket 4: M = 3, 4
    monkeypatch.setitem(dispatch._choices, (4, 64, 96, torch.float32), split_config(2, block_k=32))
    x = torch.randn(3, 64, device=DEVICE)
    hidden, _ = col(x, 1e-6)  # the deferred norm's scale and bias are the next kernel's
    residual = torch.randn(3, 64, device=DEVICE)
    want = residual + F.linear(hidden, row.weight, row.bias)
    out = row(hidden, residual)
    assert calls == [(3, 64), (3, 96)]
    torch.testing.assert_close(hidden, F.linear(x, col.weight), rtol=1e-5, atol=1e-5)
    assert out is residual
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


# ----- input validation (raises before any launch: runs in the parent too) -----


@pytest.mark.parametrize(
    "x_shape,w_shape,b_shape,dtypes,match",
    [
        ((0, 8), (4, 8), None, None, "1 <= M <= 16"),
        ((17, 8), (4, 8), None, None, "1 <= M <= 16"),
        ((2, 3, 8), (4, 8), None, None, "x must be 2-D"),
        ((2, 8), (4, 8, 1), None, None, "weight must be 2-D"),
        ((2, 8), (4, 9), None, None, "does not match x"),
        ((2, 8), (4, 8), (5,), None, "bias must have shape"),
        ((2, 8), (4, 8), None, (torch.float32, torch.float16, None), "weight dtype"),
        ((2, 8), (4, 8), (4,), (torch.float16, torch.float16, torch.float32), "bias dtype"),
        ((2, 8), (4, 8), None, (torch.float64, torch.float64, None), "not supported"),
        ((2, 8), (0, 8), None, None, "empty matmul"),
    ],
)
def test_invalid_inputs_raise(x_shape, w_shape, b_shape, dtypes, match):
    x_dtype, w_dtype, b_dtype = dtypes or (torch.float32,) * 3
    x, w = torch.zeros(x_shape, dtype=x_dtype), torch.zeros(w_shape, dtype=w_dtype)
    b = torch.zeros(b_shape, dtype=b_dtype) if b_shape else None
    with pytest.raises(ValueError, match=match):
        sg.skinny_linear(x, w, b)


@pytest.mark.parametrize(
    "residual,match",
    [
        (torch.zeros(2, 5), "residual must have shape"),
        (torch.zeros(3, 4), "residual must have shape"),
        (torch.zeros(2, 4, dtype=torch.float16), "residual dtype"),
        (torch.zeros(4, 2).t(), "unit stride along N"),
    ],
)
def test_invalid_residual_raises(residual, match):
    with pytest.raises(ValueError, match=match):
        sg.skinny_linear(torch.zeros(2, 8), torch.zeros(4, 8), residual=residual)


def test_config_that_cannot_cover_m_raises():
    with pytest.raises(ValueError, match="cannot cover"):
        sg.skinny_linear(torch.zeros(16, 8), torch.zeros(4, 8), config=sg.SkinnyConfig(16, 16, 1, 4, 2, block_m=8))


# ----- the launch heuristic (pure function of host ints) -----


def test_choose_config_fills_132_sms_on_qwen3_shapes():
    """At M=1 every Qwen3-0.6B and Qwen3-8B TP=2 projection gets >= one program per SM:
    N=1024 (64 column tiles of 16) by splitting K, larger N by its tiles alone."""
    expected_06b = {"qkv": (256, 1), "o_proj": (64, 4), "gate_up": (384, 1), "down": (64, 4)}
    for name, (N, K) in QWEN3_06B.items():
        config = sg.choose_config(1, N, K, 132)
        assert config.grid(N) == expected_06b[name], (name, config)
        assert (config.block_n, config.block_k) == (16, 256)
    for N, K in QWEN3_8B_TP2.values():
        config = sg.choose_config(1, N, K, 132)
        assert config.grid(N)[0] * config.split_k >= 132 and config.split_k == 1
    for K in (1024, 2048, 3072, 4096):  # N=1024 at any K: split until the SMs are covered
        tiles, split = sg.choose_config(1, 1024, K, 132).grid(1024)
        assert tiles * split >= 132


@pytest.mark.parametrize("M", [1, 2, 5, 8, 9, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_choose_config_tiles_cover_k_and_n(M, dtype):
    """For any shape: K splits are whole BLOCK_K steps that cover K with no empty split; the
    column tiles cover N; block sizes are powers of two >= 16 (tl.dot); split is a power of
    two <= 16; tiles fill the SMs whenever K is long enough to split."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    for N in (1, 16, 72, 1000, 1024, 4096, 151936):
        for K in (1, 16, 200, 1024, 3072, 6144):
            for num_sms in (1, 8, 132):
                c = sg.choose_config(M, N, K, num_sms, dtype)
                for block in (c.block_m, c.block_n, c.block_k):
                    assert block >= 16 and block & (block - 1) == 0
                assert c.block_m >= M and c.block_k * itemsize <= 512
                assert c.split_k in (1, 2, 4, 8, 16)
                per_split = c.k_per_split(K)
                assert per_split % c.block_k == 0
                assert per_split * c.split_k >= K > (c.split_k - 1) * per_split  # covers K, no empty split
                tiles, split = c.grid(N)
                assert (tiles - 1) * c.block_n < N <= tiles * c.block_n
                k_steps = -(-K // c.block_k)
                if tiles * split < num_sms:  # short of the SMs only when K has no step left to split
                    assert split == 16 or -(-k_steps // (2 * split)) * (2 * split - 1) >= k_steps
                assert 2 <= c.num_stages <= 4 and c.num_warps in (2, 4, 8)


def test_candidate_configs_include_the_sweep_winners():
    """The heuristic's config comes first; the 32-column, half-K-step family at the fill-the-SMs
    split and twice it follows: it holds the sweep's best config for each Qwen3-8B TP=2 shape
    at M=1 on 132 SMs (bench/NOTES.md). Every candidate covers N and K with no empty split."""
    best = {"qkv": 4, "o_proj": 2, "gate_up": 1, "down": 2}  # split of n32/k128 that won the sweep
    for name, (N, K) in QWEN3_8B_TP2.items():
        configs = sg.candidate_configs(1, N, K, 132)
        assert configs[0] == sg.choose_config(1, N, K, 132)
        assert any((c.block_n, c.block_k, c.split_k) == (32, 128, best[name]) for c in configs), (name, configs)
    for N, K in [(24, 32), *QWEN3_06B.values(), *QWEN3_8B_TP2.values()]:
        for M in (1, 7, 16):
            configs = sg.candidate_configs(M, N, K, 132)
            assert len(set(configs)) == len(configs) <= 3
            for c in configs:
                assert c.block_m >= M and (c.split_k - 1) * c.k_per_split(K) < K <= c.split_k * c.k_per_split(K)


def test_choose_config_rejects_bad_m():
    for M in (0, 17):
        with pytest.raises(ValueError, match="1 <= M <= 16"):
            sg.choose_config(M, 1024, 1024, 132)


# ----- dispatch (no launch: runs in the parent) -----


@pytest.fixture
def chosen(monkeypatch):
    """Dispatcher on, every tested shape chosen, and skinny_linear replaced by a recorder of x's shape
    (and whether a residual came)."""
    calls = []

    def record(x, w, b=None, *, residual=None, config=None, weight_scale=None):
        calls.append(tuple(x.shape) if residual is None else (tuple(x.shape), "residual"))
        return F.linear(x, w, b) if residual is None else residual.add_(F.linear(x, w, b))

    monkeypatch.setattr(dispatch, "_enabled", True)
    monkeypatch.setattr(sg, "skinny_linear", record)
    for bucket in (1, 2, 4, 8, 16, 32):
        monkeypatch.setitem(dispatch._choices, (bucket, 24, 32, torch.float32), split_config(1))
    return calls


def test_dispatcher_uses_f_linear_on_cpu(chosen):
    x, w = torch.randn(2, 32), torch.randn(24, 32)
    torch.testing.assert_close(dispatch.linear(x, w), F.linear(x, w))
    assert chosen == [] and dispatch.skinny_config(x, w) is None


@pytest.mark.parametrize("bias", [False, True])
def test_dispatcher_residual_on_cpu_is_addmm_in_place(chosen, bias):
    """Off the kernel's device, a residual is updated by `addmm_` (cuBLAS's beta=1 on GPU), then the
    bias, and returned."""
    x, w = torch.randn(3, 32), torch.randn(24, 32)
    b = torch.randn(24) if bias else None
    residual = torch.randn(3, 24)
    want = residual.addmm(x, w.t())
    if bias:
        want = want + b
    assert dispatch.linear(x, w, b, residual) is residual
    assert torch.equal(residual, want) and chosen == []


def test_dispatcher_passes_the_residual_to_skinny(chosen, monkeypatch):
    monkeypatch.setattr(dispatch, "_kernel_device", lambda x: True)
    x, w, b = torch.randn(2, 32), torch.randn(24, 32), torch.randn(24)
    residual = torch.randn(2, 24)
    want = residual + F.linear(x, w, b)
    assert dispatch.linear(x, w, b, residual) is residual
    torch.testing.assert_close(residual, want)
    assert chosen == [((2, 32), "residual")]


def test_dispatcher_choice_needs_enabled_bucket_and_shape(chosen, monkeypatch):
    monkeypatch.setattr(dispatch, "_kernel_device", lambda x: True)
    w, b = torch.randn(24, 32), torch.randn(24)
    for M in (1, 2, 3, 5, 16):
        out = dispatch.linear(torch.randn(M, 32), w, b)
        assert out.shape == (M, 24)
    assert chosen == [(1, 32), (2, 32), (3, 32), (5, 32), (16, 32)]
    chosen.clear()
    dispatch.linear(torch.randn(17, 32), w)  # M > 16: always cuBLAS, whatever the table says
    dispatch.linear(torch.randn(0, 32), w)
    dispatch.linear(torch.randn(2, 3, 32), w)  # not 2-D
    dispatch.linear(torch.randn(2, 32, dtype=torch.float64), w.double())  # dtype not in the table
    dispatch.linear(torch.randn(2, 16), torch.randn(24, 16))  # shape not in the table
    monkeypatch.setitem(dispatch._choices, (8, 24, 32, torch.float32), None)  # tuned: cuBLAS won
    dispatch.linear(torch.randn(7, 32), w)
    assert chosen == []
    monkeypatch.setattr(dispatch, "_enabled", False)
    dispatch.linear(torch.randn(2, 32), w)
    assert chosen == []


def test_moe_router_takes_the_tuned_kernel(chosen, monkeypatch):
    """The router's logits go through `linear` like a projection's: the skinny kernel where the tuning chose it
    for the gate's shape, cuBLAS elsewhere, the same logits either way."""
    monkeypatch.setattr(dispatch, "_kernel_device", lambda x: True)
    router = Router(32, 24)
    router.weight.data.normal_()
    x = torch.randn(3, 32)
    torch.testing.assert_close(router(x), F.linear(x, router.weight))
    assert chosen == [(3, 32)]
    router(torch.randn(20, 32))  # past the skinny kernel's 16 rows
    assert chosen == [(3, 32)]


def test_m_bucket():
    assert [dispatch.m_bucket(m) for m in range(1, 17)] == [1, 2, 4, 4] + [8] * 4 + [16] * 8


def test_tuning_is_a_no_op_on_cpu(monkeypatch):
    """`tune_skinny_gemm` groups the model's linear layers by (N, K, dtype), each with the bias its matmul
    adds (a column-parallel layer's none: `DeferredNorm` adds it after the scale), the MoE routers with
    them (`Router` calls `linear` too) and, without CUDA, records nothing."""
    model = torch.nn.ModuleDict({
        "a": ColumnParallelLinear(32, 24, bias=True), "b": ColumnParallelLinear(32, 24),
        "c": RowParallelLinear(24, 32, bias=True), "norm": torch.nn.LayerNorm(8), "gate": Router(32, 8),
    })
    groups = sg.linear_weights(model)
    assert sorted(groups) == [(8, 32, torch.float32), (24, 32, torch.float32), (32, 24, torch.float32)]
    assert [b is not None for _, b, _ in groups[(24, 32, torch.float32)]] == [False, False]
    assert [b is not None for _, b, _ in groups[(32, 24, torch.float32)]] == [True]
    assert groups[(8, 32, torch.float32)] == [(model["gate"].weight, None, None)]
    monkeypatch.setattr(dispatch, "_choices", {})
    assert sg.tune_skinny_gemm(model, [1, 2, 4, 8, 16, 32]) == {}
    assert dispatch._choices == {}


def test_tuning_records_the_faster_per_bucket_and_shape(monkeypatch):
    """With the timer faked: one timing per (M bucket <= 16, N, K, dtype) for cuBLAS and for each
    candidate config, each over every layer of that shape; the table records the fastest (the
    first candidate on a tie) or None where cuBLAS won."""
    model = torch.nn.ModuleList([ColumnParallelLinear(32, 24), ColumnParallelLinear(32, 24), RowParallelLinear(24, 32)])
    for p in model.parameters():
        p.data.normal_()  # torch.empty: may hold NaN, which the correctness check rejects
    timed = []

    def fake_seconds(calls):
        fn, (x, w, _) = calls[0].func, calls[0].args
        timed.append((fn.__name__, x.shape[0], tuple(w.shape), len(calls)))
        if fn is dispatch.dense_linear:
            return 1.0
        return 0.5 if w.shape == (24, 32) and x.shape[0] <= 2 else 2.0  # skinny wins there only

    monkeypatch.setattr(dispatch, "_kernel_device", lambda x: True)
    monkeypatch.setattr(sg, "graph_seconds_per_call", fake_seconds)
    monkeypatch.setattr(sg, "skinny_linear", lambda x, w, b, config, weight_scale: F.linear(x, w, b))  # correct
    monkeypatch.setattr(dispatch, "_choices", {})
    results = sg.tune_skinny_gemm(model, [1, 2, 3, 8, 16, 32, 48], min_calls=8)
    buckets = [1, 2, 4, 8, 16]  # 3 -> 4; 32 and 48 are above MAX_M
    assert sorted(results) == sorted((m, n, k, torch.float32) for m in buckets for n, k in ((24, 32), (32, 24)))
    num_sms = sg.num_sms(torch.device(DEVICE))
    assert dispatch._choices == {
        key: sg.candidate_configs(*key[:3], num_sms, torch.float32)[0] if key[1] == 24 and key[0] <= 2 else None
        for key in results}
    assert len(timed) == sum(1 + len(sg.candidate_configs(*key[:3], num_sms, torch.float32)) for key in results)
    # Two layers of shape 24 x 32, rotated to >= 8 calls; one of 32 x 24, repeated 8 times.
    assert {(shape, n) for _, _, shape, n in timed} == {((24, 32), 8), ((32, 24), 8)}


def _tune_on_rank(rank: int, port: int, skip_tuning: bool, results) -> None:
    """One rank of test_tensor_parallel_ranks_run_rank_0s_choices: the skinny kernel times faster on rank 1 only
    (`skip_tuning`: this rank's NANOINFER_SKINNY_GEMM=0)."""
    from torch import distributed as dist

    from nanoinfer.distributed import parallel_state

    if skip_tuning:
        os.environ["NANOINFER_SKINNY_GEMM"] = "0"
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    parallel_state.init_tensor_parallel(rank, 2, 1 << 20, store)  # a local rank past any GPU: gloo only
    try:
        router = Router(32, 8)
        router.weight.data.normal_()
        dispatch._kernel_device = lambda x: True
        dispatch._choices = {}
        sg.graph_seconds_per_call = lambda calls: 1.0 if calls[0].func is dispatch.dense_linear else 1.5 - rank
        sg.skinny_linear = lambda x, w, b, config, weight_scale: F.linear(x, w, b)
        timings = sg.tune_skinny_gemm(router, [1])
        results.put((rank, {key: best for key, (_, _, best) in timings.items()}, dispatch._choices))
    finally:
        parallel_state.destroy_tensor_parallel()


def _run_two_ranks(skip_tuning: tuple[bool, bool]) -> dict:
    """{rank: (its own choices, the table it records)} from two spawned gloo ranks tuning one router."""
    import multiprocessing
    import queue

    from torch import distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_tune_on_rank, args=(rank, store.port, skip_tuning[rank], results), daemon=True)
             for rank in (0, 1)]
    for process in ranks:
        process.start()
    by_rank: dict = {}
    deadline = time.monotonic() + 120
    try:
        while len(by_rank) < 2:
            try:
                rank, own, recorded = results.get(timeout=1)
                by_rank[rank] = (own, recorded)
            except queue.Empty:
                failed = [p.exitcode for p in ranks if p.exitcode not in (None, 0)]
                assert not failed and time.monotonic() < deadline, f"a rank failed (exit codes {failed}) or hung"
    finally:
        for process in ranks:
            process.join(10)
            if process.is_alive():
                process.kill()
    return by_rank


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="runs no kernel: the parent pytest runs it")
def test_tensor_parallel_ranks_run_rank_0s_choices() -> None:
    """Each rank times its own GPU; if the timings disagree, every rank still records rank 0's table, so a
    replicated layer (the MoE router) computes the same bits on every rank and no rank routes a token
    elsewhere. Here rank 1 finds the skinny kernel faster and runs cuBLAS, as rank 0 chose. Every rank reaches
    the broadcast once, even one whose NANOINFER_SKINNY_GEMM=0 (set per host in a multi-host launch)."""
    key = (1, 8, 32, torch.float32)
    by_rank = _run_two_ranks((False, False))
    assert by_rank[0][0] == {key: None} and by_rank[1][0][key] is not None  # their own timings disagree
    assert by_rank[0][1] == by_rank[1][1] == {key: None}
    by_rank = _run_two_ranks((True, False))  # rank 0 skips tuning: nobody runs the skinny kernel
    assert by_rank[0][0] == {} and by_rank[1][0][key] is not None
    assert by_rank[0][1] == by_rank[1][1] == {}


def test_tuning_never_chooses_a_kernel_that_disagrees_with_cublas(monkeypatch, caplog):
    """Each (M, N, K) is checked against F.linear before it is timed: a kernel that is wrong on
    the GPU at hand (say, a split-K race) keeps cuBLAS, however fast it is, and is logged."""
    model = torch.nn.ModuleList([ColumnParallelLinear(32, 24)])
    model[0].weight.data.normal_()
    timed = []
    monkeypatch.setattr(dispatch, "_kernel_device", lambda x: True)
    monkeypatch.setattr(sg, "graph_seconds_per_call", lambda calls: timed.append(calls) or 0.0)
    monkeypatch.setattr(sg, "skinny_linear", lambda x, w, b, config, weight_scale: F.linear(x, w, b) * 1.1)
    monkeypatch.setattr(dispatch, "_choices", {})
    results = sg.tune_skinny_gemm(model, [1, 4])
    assert dispatch._choices == {(1, 24, 32, torch.float32): None, (4, 24, 32, torch.float32): None}
    assert [r[2] for r in results.values()] == [None, None]
    assert [c[0].func for c in timed] == [dispatch.dense_linear] * 2 and "not used" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs CUDA sm_90+ (mul.rn.bf16x2)")
def test_e4m3_to_bf16_is_exact_for_every_finite_value():
    """The skinny kernel's bit-level e4m3 -> bf16 conversion equals PyTorch's for all 254 finite bit patterns
    (subnormals, both zeros, +-448), at 2 values per thread (256 over 4 warps): fewer than the 4 that each
    inline-asm call packs, so Triton pads them; masked loads past 253 values as well."""
    import triton
    import triton.language as tl

    @triton.jit
    def convert(w_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, sg.e4m3_to_bf16(tl.load(w_ptr + offs, mask=mask, other=0.0)), mask=mask)

    bits = torch.arange(256, dtype=torch.int32, device="cuda").to(torch.uint8)
    w = bits[(bits & 0x7F) != 0x7F].view(torch.float8_e4m3fn)
    for n in (w.numel(), 253):
        out = torch.full((n,), float("nan"), dtype=torch.bfloat16, device="cuda")
        convert[(1,)](w, out, n, BLOCK=256)
        assert torch.equal(out.view(torch.int16), w[:n].to(torch.bfloat16).view(torch.int16))


def test_fp8_weights_convert_bitwise_only_where_bf16x2_multiplies_run(monkeypatch):
    """`e4m3_to_bf16` is inline PTX with a bf16x2 multiply (sm_90+): Ada's fp8 weights (sm_89, which fp8 models
    accept) and the CPU interpreter must take Triton's own conversion, or the kernel fails to compile."""
    check = sg.converts_fp8_bitwise.__wrapped__
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(sg, "INTERPRETER", False)
    for capability, expected in (((8, 9), False), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert check(cuda) is expected
    assert check(torch.device("cpu")) is False
    monkeypatch.setattr(sg, "INTERPRETER", True)
    assert check(cuda) is False
