"""Tensor-parallel linear layers (Megatron style).

Each layer holds only this rank's shard of the weight and exposes a
`weight_loader(param, loaded_weight, shard_id=None)` that copies that shard
out of a full checkpoint tensor, so loading never places the whole model on
one rank. Column-parallel layers split the output features (no communication
in forward); the row-parallel layer splits the input features and sums the
partial outputs over ranks.

In the decoder every column-parallel layer follows an RMSNorm of the residual
stream and every row-parallel layer adds its output back to that stream. So the
norm's weight is folded into the column-parallel weight at load time and its
per-row scale is left to the kernel after the matmul (`DeferredNorm`), and the
row-parallel matmul adds into the stream (cuBLAS's beta = 1, or our kernels'
epilogues): the decoder's norms and residual adds cost no kernels of their own.

With LoRA adapters enabled, each layer also holds its adapters' slots (`lora`, nanoinfer/lora/layers.py) and
adds each token's adapter delta to the matmul's output, before the deferred norm scale and the all-reduce (both
linear, so they apply to the delta as they do to the product).

With `quantization="fp8"` each layer's weight becomes float8_e4m3fn with a float32 scale per output row
(`quantize_fp8`, once the norms are folded: layers/fp8.py).

Every forward's matmul goes through `nanoinfer.layers.skinny_dispatch.linear`:
`F.linear` (fp8: `fp8_matmul`), except for decode-sized inputs on a GPU where the start-up tuning
found the skinny Triton kernel faster.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoinfer.distributed.parallel_state import fused_all_reduce, tp_all_reduce, tp_rank, tp_world_size
from nanoinfer.layers.fp8 import full_row_amax, quantize_per_row, weight_device
from nanoinfer.layers.layernorm import DeferredNorm
from nanoinfer.layers.skinny_dispatch import linear
from nanoinfer.lora.layers import LoRASlots


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy with a shape check (the dtype is converted by the copy)."""
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: checkpoint slice {tuple(src.shape)}, parameter slice {tuple(dst.shape)}")
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: None = None) -> None:
    """Loader for replicated parameters (norms): the checkpoint tensor is the parameter."""
    copy_weight(param.data, loaded_weight)


def reduce_partial(partial: torch.Tensor, residual: torch.Tensor | None, slot: int) -> torch.Tensor:
    """The sum of `partial` over the TP ranks, plus `residual` when given: our fused all-reduce + add kernel on GPUs
    that allow it (consecutive calls must use different `slot`s: kernels/all_reduce.py), else the backend's
    all-reduce (NCCL, gloo) and an add."""
    kernel = fused_all_reduce()
    if kernel is not None and kernel.fits(partial):
        return kernel(partial, residual, slot)
    total = tp_all_reduce(partial)
    return total if residual is None else total.add_(residual)


def shard_of(tensor: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous 1/world_size slice of `tensor` along `dim` (a view, no copy)."""
    size = divide(tensor.shape[dim], world_size, f"checkpoint dim {dim} of shape {tuple(tensor.shape)}")
    return tensor.narrow(dim, rank * size, size)


class LinearBase(nn.Module):
    """Owns this rank's weight (and bias) shard; subclasses define how forward combines shards
    and how `weight_loader` cuts a checkpoint tensor."""

    rows_split = False  # whether each tensor-parallel rank holds a slice of every weight row (row-parallel)

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        """Sizes are this rank's (already divided)."""
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_world_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, device=weight_device()), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.lora: LoRASlots | None = None  # set by the runner's LoRAModelManager when enable_lora
        # fp8 weights: float32 [output_size] (`quantize_fp8`); a buffer, so it follows the module's device.
        self.register_buffer("weight_scale", None, persistent=False)

    def quantize_fp8(self, device: torch.device) -> None:
        """The loaded (and norm-folded) weight, moved to `device` (from host memory: `weights_on_host`), to
        float8_e4m3fn with one scale per output row."""
        if self.weight_scale is not None:
            raise RuntimeError(f"{type(self).__name__}: the weight is fp8 already")
        weight = self.weight.data.to(device)
        q, scale = quantize_per_row(weight, full_row_amax(weight, self.rows_split))
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = scale


class ColumnParallelLinear(LinearBase):
    """y = RMSNorm(h) W^T + b with W's rows (output features) split over ranks; each rank keeps its slice of y.
    The norm's weight is folded into W once the checkpoint is loaded (`fold_norm`); forward multiplies the
    residual stream h as it is and hands the norm's row scale and the bias to the next kernel."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, divide(output_size, tp_world_size(), "output_size"), bias)
        self.norm_weight: torch.Tensor | None = None  # the folded norm's weight (LoRA's A is folded with it too)

    def shard_range(self, shard_id) -> tuple[int, int]:
        """(offset, size) along dim 0 of this rank's parameter that checkpoint shard `shard_id` fills."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard_id, got {shard_id!r}")
        return 0, self.weight.shape[0]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        offset, size = self.shard_range(shard_id)
        copy_weight(param.data.narrow(0, offset, size), shard_of(loaded_weight, 0, self.tp_rank, self.tp_size))

    def fold_norm(self, norm_weight: torch.Tensor) -> None:
        """W[:, i] *= g[i], rounded once: RMSNorm(h) W^T = r * (h (W * g)^T) for the norm's weight g (where W is,
        which may be host memory: `weights_on_host`)."""
        self.weight.copy_((self.weight.float() * norm_weight.to(self.weight.device).float()).to(self.weight.dtype))
        self.norm_weight = norm_weight.detach()  # (a plain tensor: not a second parameter of this layer)

    def forward(self, hidden: torch.Tensor, eps: float) -> tuple[torch.Tensor, DeferredNorm]:
        """(h W^T, what the kernel after the matmul applies: the norm's scale of each row, then the bias)."""
        out = linear(hidden, self.weight, weight_scale=self.weight_scale)
        if self.lora is not None:
            self.lora.add_to(out, hidden)
        return out, DeferredNorm(hidden, eps, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up:
    shard_id 0 and 1). Each rank holds its slice of every projection, back to back."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        for size in output_sizes:
            divide(size, tp_world_size(), "output_size")
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = output_sizes

    def shard_range(self, shard_id: int) -> tuple[int, int]:
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        return offset, self.output_sizes[shard_id] // self.tp_size


class QKVParallelLinear(ColumnParallelLinear):
    """Fused Q, K, V projections (shard_id "q", "k", "v"). Query and KV heads are split evenly
    over ranks, so each rank's attention is self-contained (GQA groups stay on one rank)."""

    def __init__(
        self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int, bias: bool = False
    ) -> None:
        world = tp_world_size()
        if total_num_heads % world or total_num_kv_heads % world:
            valid = [s for s in range(1, total_num_kv_heads + 1) if total_num_heads % s == 0 and total_num_kv_heads % s == 0]
            raise ValueError(
                f"tensor-parallel size {world} must divide num_attention_heads={total_num_heads} and "
                f"num_key_value_heads={total_num_kv_heads}; valid tensor-parallel sizes: {valid}"
            )
        super().__init__(hidden_size, (total_num_heads + 2 * total_num_kv_heads) * head_dim, bias)
        self.num_heads, self.num_kv_heads = total_num_heads // world, total_num_kv_heads // world
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim

    def shard_range(self, shard_id: str) -> tuple[int, int]:
        ranges = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size), "v": (self.q_size + self.kv_size, self.kv_size)}
        if shard_id not in ranges:
            raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        return ranges[shard_id]


class RowParallelLinear(LinearBase):
    """residual + x W^T + b with W's columns (input features) split over ranks: the input arrives
    already split (from a column-parallel layer), and the partial products are summed over ranks
    together with the residual stream (`reduce_partial` in `all_reduce_slot`)."""

    rows_split = True  # (an fp8 row's scale is the whole row's: the same weights at every tensor-parallel size)

    def __init__(self, input_size: int, output_size: int, bias: bool = False, all_reduce_slot: int = 0) -> None:
        super().__init__(divide(input_size, tp_world_size(), "input_size"), output_size, bias)
        self.all_reduce_slot = all_reduce_slot

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if param is self.weight:
            loaded_weight = shard_of(loaded_weight, 1, self.tp_rank, self.tp_size)
        copy_weight(param.data, loaded_weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The residual stream with this layer's output added: in place on one GPU (the matmul's epilogue)."""
        if self.tp_size == 1:
            out = linear(x, self.weight, self.bias, residual=residual, weight_scale=self.weight_scale)
            return out if self.lora is None else self.lora.add_to(out, x)
        return reduce_partial(self.partial(x), residual, self.all_reduce_slot)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of x W^T + b, before the sum over ranks (a caller that sums it with more parts: an MoE
        block's shared expert)."""
        # The (replicated) bias is added by rank 0 only, so the sum counts it once.
        out = linear(x, self.weight, self.bias if self.tp_rank == 0 else None, weight_scale=self.weight_scale)
        if self.lora is not None:  # this rank's input shard through its A shard: the all-reduce sums the parts
            self.lora.add_to(out, x)
        return out
