"""LoRA's masked expand kernel (kernels/lora.py) against the PyTorch path it replaces (lora/layers.py: a one-hot
mask multiply and an addmm), through `LoRASlots.add_to` with the fused kernels on and off. Kernel launches run in
Triton's interpreter on CPU, in a child pytest (tests/triton_child.py).

Tolerances: float32 differs only by the summation order (~1e-6 relative); 16-bit outputs are rounded once from a
float32 sum in both paths, so by at most an ulp or two of the output. A token given another slot's columns, or a
dropped column, is off by O(1)."""

from __future__ import annotations

import pytest
import torch
from triton_child import interpreter_child, kernel_test

from nanoinfer.layers import fusion
from nanoinfer.lora.layers import LoRASlots

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}

test_cpu_interpreter_child = interpreter_child(__file__)


def slots_with_adapters(tokens: int, subs: int, num_slots: int, rank: int, dtype: torch.dtype, seed: int):
    """A layer's slots (`subs` packed sub-projections of 24 outputs each, input 40) with random adapters, and a
    step's mapping: token t in slot t % (num_slots + 1), the last of those meaning no adapter (-1): every slot and
    none, interleaved."""
    g = torch.Generator().manual_seed(seed)
    in_features, sub_out = 40, 24
    token_slots = torch.tensor([-1 if t % (num_slots + 1) == num_slots else t % (num_slots + 1) for t in range(tokens)],
                               dtype=torch.int32, device=DEVICE)
    mapping = token_slots[:, None] == torch.arange(num_slots, device=DEVICE)[None, :]
    slots = LoRASlots(in_features, [(i * sub_out, sub_out) for i in range(subs)], subs * sub_out, num_slots, rank,
                      mapping, token_slots, dtype)
    for slot in range(num_slots):
        for sub in range(subs):
            adapter_rank = rank - slot % 2  # some adapters narrower than the slot
            slots.write(slot, sub, torch.randn(adapter_rank, in_features, generator=g),
                        torch.randn(sub_out, adapter_rank, generator=g))
    x = torch.randn(tokens, in_features, generator=g).to(DEVICE, dtype)
    out = torch.randn(tokens, subs * sub_out, generator=g).to(DEVICE, dtype)
    return slots, x, out


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,subs,num_slots,rank", [(1, 1, 1, 8), (5, 3, 2, 16), (17, 2, 3, 4), (70, 1, 4, 8)])
def test_lora_expand_kernel_equals_the_pytorch_path(dtype, tokens, subs, num_slots, rank, monkeypatch) -> None:
    slots, x, out = slots_with_adapters(tokens, subs, num_slots, rank, dtype, seed=tokens)
    expected = slots.add_to(out.clone(), x)
    monkeypatch.setattr(fusion, "_enabled", True)
    monkeypatch.setattr(fusion, "_kernel_device", lambda t: t.is_cuda or t.device.type == "cpu")
    target = out.clone()
    result = slots.add_to(target, x)
    assert result.data_ptr() == target.data_ptr()  # in place, as the PyTorch path
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(result.float(), expected.float(), atol=atol * 10, rtol=rtol)
    untouched = slots.token_slots == -1  # tokens without an adapter keep their output exactly
    assert torch.equal(result[untouched], out[untouched])
    assert not torch.allclose(result[~untouched].float(), out[~untouched].float())  # the others got a delta


@kernel_test
@pytest.mark.parametrize("kernels", [False, True])
def test_an_overflowing_slot_leaves_other_tokens_alone(kernels, monkeypatch) -> None:
    """Slot 1's A so large that its shrunk columns overflow to inf for every token: tokens of slot 0 and of no
    adapter still get exactly what they get without slot 1 (the mask selects; inf x 0 would be NaN)."""
    slots, x, out = slots_with_adapters(9, 2, 2, 8, torch.float32, seed=5)
    if kernels:
        monkeypatch.setattr(fusion, "_enabled", True)
        monkeypatch.setattr(fusion, "_kernel_device", lambda t: t.is_cuda or t.device.type == "cpu")
    others = slots.token_slots != 1
    expected = slots.add_to(out.clone(), x)[others]
    for sub in range(2):
        slots.write(1, sub, torch.full((8, 40), 1e38), torch.ones(24, 8))
    result = slots.add_to(out.clone(), x)
    assert torch.equal(result[others], expected) and torch.isfinite(result[others]).all()
