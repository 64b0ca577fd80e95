"""The RMSNorm and SiLU-and-mul (with the deferred input norm) Triton kernels against
the PyTorch math they replace (layers/layernorm.py, layers/activation.py), and the layers' dispatch to them.

Kernel launches run in Triton's interpreter on CPU, in a child pytest (tests/triton_child.py).
Tolerances: float32 differs only by the reduction order (~1e-6); 16-bit results by the
roundings on the way (the interpreter truncates to 16 bits where the GPU rounds, and the
kernel's exp is not PyTorch's): at most two ulp, relative 2e-2 for bf16, 4e-3 for fp16;
SiLU-and-mul rounds four times (scaled gate and up, silu, product): four bf16 ulp, 4e-2.
A wrong row, column, mask or statistic is off by O(1)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_triton_kernels import make_input_norm
from triton_child import interpreter_child, kernel_test

from nanoinfer.layers import fusion
from nanoinfer.layers.activation import SiluAndMul, silu_and_mul_math
from nanoinfer.layers.layernorm import DeferredNorm, RMSNorm, rms_norm_math

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}
SILU_TOL = {**TOL, torch.bfloat16: (4e-2, 4e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

test_cpu_interpreter_child = interpreter_child(__file__)


@pytest.fixture
def kernels_on(monkeypatch):
    """Fusion on, with the CPU interpreter counted as a kernel device."""
    monkeypatch.setattr(fusion, "_enabled", True)
    monkeypatch.setattr(fusion, "_kernel_device", lambda x: x.is_cuda or x.device.type == "cpu")


def tensors(rows: int, cols: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, cols, generator=g)).to(DEVICE, dtype)
    weight = (torch.rand(cols, generator=g) + 0.5).to(DEVICE, dtype)
    return x, weight


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 1024), (7, 96), (33, 1000), (4, 4096)])
def test_rms_norm_kernel_matches_math(dtype, rows, cols) -> None:
    from nanoinfer.kernels.rms_norm import rms_norm

    x, weight = tensors(rows, cols, dtype)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_math(x, weight, 1e-6), rtol=rtol, atol=atol)


@kernel_test
def test_rms_norm_kernel_takes_row_strides_and_empty_batches() -> None:
    from nanoinfer.kernels.rms_norm import rms_norm

    x, weight = tensors(5, 256, torch.float32)
    wide = torch.cat([x, x], dim=1)[:, :256]  # row stride 512
    torch.testing.assert_close(rms_norm(wide, weight, 1e-5), rms_norm_math(x, weight, 1e-5))
    empty = rms_norm(x[:0], weight, 1e-5)
    assert empty.shape == (0, 256)


def test_silu_and_mul_math_of_the_folded_projection_is_the_normalised_ones() -> None:
    """The norm weight folded into gate_up and r applied after it: the activation of RMSNorm(h) @ W^T + b."""
    g = torch.Generator().manual_seed(0)
    hidden, weight, bias = torch.randn(5, 96, generator=g), torch.randn(64, 96, generator=g), torch.randn(64, generator=g)
    norm_weight = torch.rand(96, generator=g) + 0.5
    hidden[2] *= 50
    gate, up = (rms_norm_math(hidden, norm_weight, 1e-6) @ weight.t() + bias).chunk(2, dim=-1)
    folded = hidden @ (weight * norm_weight).t()
    # float32 dot products of 96 terms, associated differently: a wrong r or bias is off by O(1).
    torch.testing.assert_close(silu_and_mul_math(folded, DeferredNorm(hidden, 1e-6, bias)), F.silu(gate) * up,
                               rtol=1e-4, atol=1e-4)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows,d,hidden_size", [(1, 3072, 1024), (9, 48, 96), (40, 1500, 1000), (3, 8, 4096)])
def test_silu_and_mul_kernel_matches_math(dtype, bias, rows, d, hidden_size) -> None:
    """Strided rows of x and of the residual rows behind them, whose scales differ by up to 1000 (so r matters);
    several column tiles of a row (d = 1500, 3072) each take r from the whole row; hidden widths not a power of two."""
    from nanoinfer.kernels.activation import silu_and_mul

    g = torch.Generator().manual_seed(d)
    x = (4 * torch.randn(rows, 2 * d + 6, generator=g)).to(DEVICE, dtype)[:, : 2 * d]
    norm = make_input_norm(rows, hidden_size, dtype, bias_width=2 * d if bias else None, seed=d)
    rtol, atol = SILU_TOL[dtype]
    torch.testing.assert_close(silu_and_mul(x, norm.hidden, norm.eps, norm.bias), silu_and_mul_math(x, norm),
                               rtol=rtol, atol=atol)
    assert silu_and_mul(x[:0], norm.hidden[:0], norm.eps).shape == (0, d)


@kernel_test
def test_deferred_norm_kernels_sum_wide_rows_in_chunks(monkeypatch) -> None:
    """A residual row wider than one load (MAX_BLOCK_H, lowered here from 16,384 to 64) is summed in chunks, the
    last one partial (1,000 = 15 x 64 + 40): SiLU-and-mul and rotate_and_cache still give the PyTorch path's r."""
    from nanoinfer.attention.torch_backend import TorchAttentionBackend
    from nanoinfer.kernels import activation, deferred_norm
    from nanoinfer.kernels.rotate_and_cache import rotate_and_cache
    from test_triton_kernels import make_qkv_inputs

    monkeypatch.setattr(deferred_norm, "MAX_BLOCK_H", 64)
    norm = make_input_norm(5, 1000, torch.float32, bias_width=96)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    torch.testing.assert_close(activation.silu_and_mul(x, norm.hidden, norm.eps, norm.bias), silu_and_mul_math(x, norm))
    qkv, positions, rope, (q_norm, k_norm) = make_qkv_inputs(5, 2, 1, 32, torch.float32, qk_norm=True)
    norm = make_input_norm(5, 1000, torch.float32, bias_width=qkv.shape[1])
    k_cache, v_cache = torch.zeros(2, 2, 16, 1, 32, device=DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([0, 1, 2, 17, 30], device=DEVICE)
    ref_q = TorchAttentionBackend().rotate_and_cache(qkv, positions, rope, q_norm, k_norm, ref_k, ref_v, slots, 2, norm)
    query = rotate_and_cache(qkv, positions, rope.cos_cache, rope.sin_cache, q_norm.weight, k_norm.weight, q_norm.eps,
                             k_cache, v_cache, slots, 2, norm.hidden, norm.eps, norm.bias)
    for out, ref in ((query, ref_q), (k_cache, ref_k), (v_cache, ref_v)):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_kernels_reject_what_they_do_not_take() -> None:
    from nanoinfer.kernels import activation, rms_norm

    x = torch.randn(4, 64)
    assert not rms_norm.supports(x, torch.ones(32))  # weight of another width
    assert not rms_norm.supports(x, torch.ones(64, dtype=torch.float64))  # weight of another dtype
    assert not rms_norm.supports(x.t(), torch.ones(4))  # no unit last stride
    hidden = torch.randn(4, 96)
    assert activation.supports(x, hidden) and activation.supports(x, hidden, torch.ones(64))
    assert not activation.supports(torch.randn(4, 63), hidden)  # odd width: no gate / up halves
    assert not activation.supports(torch.randn(2, 4, 64), hidden)  # not 2-D
    assert not activation.supports(x, hidden[:3])  # hidden rows of other tokens
    assert not activation.supports(x, hidden.double())  # hidden of another dtype
    assert not activation.supports(x, torch.randn(96, 4).t())  # hidden without unit last stride
    assert not activation.supports(x, hidden[:, :0])  # no hidden values
    assert activation.supports(x, torch.randn(4, 16385))  # wider than one load: summed in chunks
    assert not activation.supports(x, hidden, torch.ones(32))  # bias of the gate half only
    assert not activation.supports(x, hidden, torch.ones(64, 2)[:, 0])  # strided bias
    with pytest.raises(ValueError, match="rms_norm kernel: unsupported"):
        rms_norm.rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="silu_and_mul kernel: unsupported"):
        activation.silu_and_mul(torch.randn(4, 63), hidden, 1e-6)


@kernel_test
def test_layers_dispatch_to_the_kernels(kernels_on, monkeypatch) -> None:
    """With fusion on, the norm and the activation layers run the kernels (counted), and give
    what the plain PyTorch path gives; inputs the kernels do not take fall back to it."""
    from nanoinfer.kernels import activation, rms_norm

    calls = []
    for module, name in ((rms_norm, "rms_norm"), (activation, "silu_and_mul")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    x, _ = tensors(6, 128, torch.float32)
    norm = RMSNorm(128, eps=1e-6).to(DEVICE)
    norm.weight.data = torch.rand(128, generator=torch.Generator().manual_seed(1)).to(DEVICE) + 0.5
    torch.testing.assert_close(norm(x), rms_norm_math(x, norm.weight, 1e-6))
    gated = torch.randn(6, 256, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    input_norm = make_input_norm(6, 96, torch.float32, bias_width=256)
    torch.testing.assert_close(SiluAndMul()(gated, input_norm), silu_and_mul_math(gated, input_norm))
    assert calls == ["rms_norm", "silu_and_mul"]
    norm(x.double())  # float64: not a kernel dtype, the PyTorch path runs
    SiluAndMul()(torch.randn(2, 3, 64, device=DEVICE), DeferredNorm(torch.randn(2, 3, 96, device=DEVICE), 1e-6))  # 3-D
    SiluAndMul()(gated, DeferredNorm(input_norm.hidden.double(), 1e-6))  # hidden of another dtype: PyTorch path
    assert calls == ["rms_norm", "silu_and_mul"]
