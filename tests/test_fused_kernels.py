"""The fused add + RMSNorm and SiLU-and-mul Triton kernels against the PyTorch math they
replace (layers/layernorm.py, layers/activation.py), and the layers' dispatch to them.

Kernel launches run in Triton's interpreter on CPU, in a child pytest (tests/triton_child.py).
Tolerances: float32 differs only by the reduction order (~1e-6); 16-bit results by the
roundings on the way (the interpreter truncates to 16 bits where the GPU rounds, and the
kernel's exp is not PyTorch's): at most two ulp, relative 2e-2 for bf16, 4e-3 for fp16.
A wrong row, column, mask or statistic is off by O(1)."""

from __future__ import annotations

import pytest
import torch
from triton_child import interpreter_child, kernel_test

from nanoinfer.layers import fusion
from nanoinfer.layers.activation import SiluAndMul, silu_and_mul_math
from nanoinfer.layers.layernorm import RMSNorm, add_rms_norm_math, rms_norm_math

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}
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
    residual = torch.randn(rows, cols, generator=g).to(DEVICE, dtype)
    weight = (torch.rand(cols, generator=g) + 0.5).to(DEVICE, dtype)
    return x, residual, weight


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 1024), (7, 96), (33, 1000), (4, 4096)])
def test_rms_norm_kernel_matches_math(dtype, rows, cols) -> None:
    from nanoinfer.kernels.rms_norm import rms_norm

    x, residual, weight = tensors(rows, cols, dtype)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_math(x, weight, 1e-6), rtol=rtol, atol=atol)
    out, summed = rms_norm(x, weight, 1e-6, residual)
    torch.testing.assert_close(summed, x + residual, rtol=rtol, atol=atol)
    # The norm of the kernel's own sum: one sum's rounding must not count twice.
    torch.testing.assert_close(out, rms_norm_math(summed, weight, 1e-6), rtol=rtol, atol=atol)


@kernel_test
def test_rms_norm_kernel_takes_row_strides_and_empty_batches() -> None:
    from nanoinfer.kernels.rms_norm import rms_norm

    x, residual, weight = tensors(5, 256, torch.float32)
    wide = torch.cat([x, x], dim=1)[:, :256]  # row stride 512
    out, summed = rms_norm(wide, weight, 1e-5, residual)
    expected_out, expected_sum = add_rms_norm_math(x, residual, weight, 1e-5)
    torch.testing.assert_close(summed, expected_sum)
    torch.testing.assert_close(out, expected_out)
    empty = rms_norm(x[:0], weight, 1e-5)
    assert empty.shape == (0, 256)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 3072), (9, 48), (3, 1500)])
def test_silu_and_mul_kernel_matches_math(dtype, rows, d) -> None:
    from nanoinfer.kernels.activation import silu_and_mul

    g = torch.Generator().manual_seed(d)
    x = (4 * torch.randn(rows, 2 * d, generator=g)).to(DEVICE, dtype)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_math(x), rtol=rtol, atol=atol)


def test_kernels_reject_what_they_do_not_take() -> None:
    from nanoinfer.kernels import activation, rms_norm

    x = torch.randn(4, 64)
    assert not rms_norm.supports(x, torch.ones(32))  # weight of another width
    assert not rms_norm.supports(x, torch.ones(64, dtype=torch.float64))  # weight of another dtype
    assert not rms_norm.supports(x.t(), torch.ones(4))  # no unit last stride
    assert not rms_norm.supports(x, torch.ones(64), torch.randn(4, 32))  # residual of another shape
    assert not activation.supports(torch.randn(4, 63))  # odd width: no gate / up halves
    assert not activation.supports(torch.randn(2, 4, 64))  # not 2-D
    with pytest.raises(ValueError, match="rms_norm kernel: unsupported"):
        rms_norm.rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="silu_and_mul kernel: unsupported"):
        activation.silu_and_mul(torch.randn(4, 63))


@kernel_test
def test_layers_dispatch_to_the_kernels(kernels_on, monkeypatch) -> None:
    """With fusion on, the norm and the activation layers run the kernels (counted), and give
    what the plain PyTorch path gives; inputs the kernels do not take fall back to it."""
    from nanoinfer.kernels import activation, rms_norm

    calls = []
    for module, name in ((rms_norm, "rms_norm"), (activation, "silu_and_mul")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    x, residual, _ = tensors(6, 128, torch.float32)
    norm = RMSNorm(128, eps=1e-6).to(DEVICE)
    norm.weight.data = torch.rand(128, generator=torch.Generator().manual_seed(1)).to(DEVICE) + 0.5
    out, summed = norm(x, residual)
    expected_out, expected_sum = add_rms_norm_math(x, residual, norm.weight, 1e-6)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(summed, expected_sum)
    torch.testing.assert_close(norm(x), rms_norm_math(x, norm.weight, 1e-6))
    gated = torch.randn(6, 256, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    torch.testing.assert_close(SiluAndMul()(gated), silu_and_mul_math(gated))
    assert calls == ["rms_norm", "rms_norm", "silu_and_mul"]
    norm(x.double(), residual.double())  # float64: not a kernel dtype, the PyTorch path runs
    SiluAndMul()(torch.randn(2, 3, 64, device=DEVICE))  # 3-D: PyTorch path
    assert calls == ["rms_norm", "rms_norm", "silu_and_mul"]
