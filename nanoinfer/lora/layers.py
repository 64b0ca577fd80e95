"""Every adapter slot's weights for one linear layer, and the delta they add to its output.

A step's tokens may each use a different adapter (or none), so the layer cannot run one adapter's matmuls;
instead all slots' A matrices are stacked into one [subs x slots x rank, in] matrix and all B matrices into one
[out, subs x slots x rank] matrix (block diagonal over the packed sub-projections: q/k/v, gate/up), and a
token's shrunk row is zeroed outside its own slot's columns by a [tokens, slots] one-hot `mapping` before the
expand. Two matmuls per layer whatever the mix of adapters, the same shapes every step (so CUDA graphs hold
them), and at `max_loras x max_lora_rank` columns a few percent of the layer's own matmul. On a GPU with the
fused kernels on, the mask and the expand are one Triton kernel (kernels/lora.py), which reads each token's slot
instead of the one-hot rows."""

from __future__ import annotations

import torch

from nanoinfer.layers.fusion import use_kernels


class LoRASlots:
    def __init__(self, in_features: int, out_slices: list[tuple[int, int]], out_features: int, num_slots: int,
                 max_rank: int, mapping: torch.Tensor, token_slots: torch.Tensor, dtype: torch.dtype) -> None:
        """`out_slices`: (offset, size) of each packed sub-projection in this rank's output; `mapping`, `token_slots`:
        the runner's [max tokens, num_slots] one-hot (bool) buffer and [max tokens] slot per token (-1: none),
        filled each step (`LoRAModelManager.set_mapping`); `dtype`: the model's."""
        self.out_slices, self.num_slots, self.max_rank = out_slices, num_slots, max_rank
        width = len(out_slices) * num_slots * max_rank
        self.lora_a = torch.zeros(width, in_features, dtype=dtype, device=mapping.device)
        self.lora_b = torch.zeros(out_features, width, dtype=dtype, device=mapping.device)
        self.mapping, self.token_slots = mapping, token_slots

    def _columns(self, sub: int, slot: int) -> slice:
        start = (sub * self.num_slots + slot) * self.max_rank
        return slice(start, start + self.max_rank)

    def clear(self, slot: int) -> None:
        for sub in range(len(self.out_slices)):
            self.lora_a[self._columns(sub, slot)] = 0
            self.lora_b[:, self._columns(sub, slot)] = 0

    def write(self, slot: int, sub: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """One adapter's A [r, in] and (scaled) B [sub's out, r], this rank's shards, into `slot`."""
        columns = self._columns(sub, slot)
        rank = a.shape[0]
        offset, size = self.out_slices[sub]
        self.lora_a[columns.start : columns.start + rank] = a
        self.lora_b[offset : offset + size, columns.start : columns.start + rank] = b

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out += each token's own adapter's B A x (in place; returned)."""
        tokens = x.shape[0]
        shrunk = torch.mm(x, self.lora_a.t())
        if use_kernels(x):
            from nanoinfer.kernels.lora import lora_expand  # triton: GPU runs only

            return lora_expand(out, shrunk, self.lora_b, self.token_slots[:tokens], self.num_slots, self.max_rank)
        # Selected, not multiplied: another slot's column may overflow (inf), and inf x 0 would be NaN.
        shrunk = torch.where(self.mapping[:tokens, None, :, None],
                             shrunk.view(tokens, len(self.out_slices), self.num_slots, self.max_rank), 0)
        return out.addmm_(shrunk.view(tokens, -1), self.lora_b.t())
