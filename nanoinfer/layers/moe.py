"""Mixture-of-experts feed-forward block (Qwen3-MoE, Qwen2-MoE, Mixtral): a router picks each token's top-k
experts, and the token's output is the routing-weighted sum of those experts' SiLU-gated MLPs (plus, in Qwen2-MoE,
a gated shared expert's).

All experts' weights live in two stacked tensors, `w13` [E, 2 * I, H] (each expert's gate rows, then its up
rows) and `w2` [E, H, I], so each of the block's two matmuls is one grouped-GEMM launch for every expert
(kernels/moe.py on a GPU: with the input norm, the gate's matmul, the routing, the sort by expert (two) and the
weighted sum, eight kernels a layer and no host synchronisation; `fused_moe_math` elsewhere). Under tensor
parallelism each rank holds every expert's slice of the intermediate dimension (the gate/up rows and the down
columns, as a dense MLP is split): the ranks' partial outputs are summed with the residual stream by the same
all-reduce as the dense MLP's (`reduce_partial`). The router is replicated.

Unlike the dense MLP's, this block's input RMSNorm is not folded into the projections after it: the router and
the experts both read the normalised stream, which is computed once here (one kernel on a GPU).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.distributed.parallel_state import tp_rank, tp_world_size
from nanoinfer.layers.fp8 import dequantized, full_row_amax, quantize_per_row, weight_device
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.linear import copy_weight, divide, reduce_partial, shard_of
from nanoinfer.layers.skinny_dispatch import linear


def num_experts_of(config: Any) -> int:
    """Experts per MoE layer: Qwen's `num_experts`, Mixtral's `num_local_experts` (0: a dense model)."""
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0


def is_moe_layer(config: Any, layer_idx: int) -> bool:
    """Whether decoder layer `layer_idx` has an MoE block (Qwen's MoE models may keep some layers dense:
    `mlp_only_layers`, and `decoder_sparse_step`)."""
    if num_experts_of(config) == 0:
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and (layer_idx + 1) % step == 0


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts by softmax probability (in float32, as transformers computes them):
    (their weights [T, k] float32, renormalised to sum to one where the model asks; their ids [T, k] int32).
    Of equal probabilities the lowest-numbered expert comes first, as in the routing kernel, so the CPU and the
    GPU pick the same experts (bf16 logits tie often: two of 128 experts share the 8th place for ~6% of tokens;
    torch.topk's own order among ties differs between devices)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k].contiguous(), ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def fused_moe_math(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                   w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * MLP_e(x[t]) for e = topk_ids[t, j], where MLP_e(x) = (silu(x G_e^T) * x U_e^T)
    D_e^T with w13[e] = [G_e; U_e] and w2[e] = D_e (fp8 weights: times their row scales, `w13_scale` [E, 2I] and
    `w2_scale` [E, H]). Each expert's matmuls and activation round to x's dtype, as transformers' do; the weighted
    sum is float32, rounded once. Plain PyTorch (one pass per expert in use, whose token lists are data-dependent):
    the CPU path, and the reference of the fused kernel (kernels/moe.py)."""
    intermediate = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for expert in topk_ids.unique().tolist():
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        gate_up = x[token] @ dequantized(w13[expert], None if w13_scale is None else w13_scale[expert], x.dtype).t()
        hidden = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        down = hidden @ dequantized(w2[expert], None if w2_scale is None else w2_scale[expert], x.dtype).t()
        out.index_add_(0, token, down.float() * topk_weights[token, slot, None])
    return out.to(x.dtype)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`route`, as one Triton kernel on a GPU."""
    if _kernel_device(router_logits) and router_logits.stride(1) == 1:
        from nanoinfer.kernels import moe as kernel  # triton: GPU (or interpreter) only

        return kernel.topk_softmax(router_logits, top_k, renormalize)
    return route(router_logits, top_k, renormalize)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, residual: torch.Tensor | None = None, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`fused_moe_math`, as our Triton kernels on a GPU (no host synchronisation: CUDA graphs capture it). With
    `residual`, the result is added to it in place (by the kernels' last one), and `residual` returned."""
    if _kernel_device(x):
        from nanoinfer.kernels import moe as kernel  # triton: GPU (or interpreter) only

        if kernel.supports(x, w13, w2, w13_scale, w2_scale):
            return kernel.fused_moe(x, w13, w2, topk_weights, topk_ids, residual, w13_scale, w2_scale)
    out = fused_moe_math(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    return out if residual is None else residual.add_(out)


def _kernel_device(x: torch.Tensor) -> bool:
    """Where the kernels run (tests widen this to the CPU interpreter). Unlike the small fused pieces (`use_kernels`)
    they run with enforce_eager too: the PyTorch math waits on the host for each expert's token list."""
    return x.is_cuda


class Router(nn.Module):
    """The replicated gate: router logits [T, E] = x W^T, in the model's dtype (as transformers computes them).
    Never quantized. Through `linear`, so decode steps take the skinny kernel where the start-up tuning finds it
    faster: cuBLAS runs Qwen3-30B-A3B's [128, 2048] gate at one token on 2 thread blocks (5 us on an H200)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


def quantize_experts(weight: torch.Tensor, rows_split: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked experts [E, N, K] -> (float8_e4m3fn [E, N, K], float32 scales [E, N]): each expert's rows as a
    linear layer's (`quantize_per_row`; `rows_split`: this rank holds a slice of every row, `full_row_amax`)."""
    rows = weight.flatten(0, 1)
    q, scale = quantize_per_row(rows, full_row_amax(rows, rows_split))
    return q.view(weight.shape), scale.view(weight.shape[:2])


class FusedMoE(nn.Module):
    """Every expert's gate/up and down weights, this rank's slice of each (`w13_weight`, `w2_weight`).

    A checkpoint stores one tensor per expert and projection (`experts.<e>.gate_proj.weight`, or Mixtral's
    `w1` / `w3` / `w2`), or, saved by transformers 5 without its legacy names, the stacked `experts.gate_up_proj`
    [E, 2I, H] and `experts.down_proj` [E, H, I], our own layout. Each parameter lists both namings
    (`checkpoint_names`, read by the loader), each name with the shard id `weight_loader` receives: (expert,
    0 gate | 1 up | None down), or "stacked"."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 projection_names: tuple[str, str, str]) -> None:
        """projection_names: the checkpoint's (gate, up, down) names inside each expert."""
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_world_size()
        self.intermediate_size_per_partition = divide(intermediate_size, self.tp_size, "the experts' intermediate size")
        size = self.intermediate_size_per_partition
        device = weight_device()  # (host memory for a model to quantize: `quantize_fp8`)
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * size, hidden_size, device=device),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, size, device=device), requires_grad=False)
        # fp8 weights: float32 scales per expert and output row, [E, 2I] and [E, H] (`quantize_fp8`).
        self.register_buffer("w13_scale", None, persistent=False)
        self.register_buffer("w2_scale", None, persistent=False)
        gate, up, down = projection_names
        self.w13_weight.checkpoint_names = [
            {f"{e}.{name}.weight": (e, half) for e in range(num_experts) for half, name in ((0, gate), (1, up))},
            {"gate_up_proj": "stacked"}]
        self.w2_weight.checkpoint_names = [{f"{e}.{down}.weight": (e, None) for e in range(num_experts)},
                                           {"down_proj": "stacked"}]
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: tuple[int, int | None] | str) -> None:
        """One expert's gate or up rows (this rank's slice of them) or its down columns; or all experts' at once
        ("stacked": [E, 2I, H] gate rows then up rows, or [E, H, I])."""
        size = self.intermediate_size_per_partition
        if shard_id == "stacked":
            if param is self.w13_weight:
                if loaded_weight.dim() != 3 or loaded_weight.shape[1] % 2:
                    raise ValueError(f"stacked gate/up experts must be [E, 2I, H], got {tuple(loaded_weight.shape)}")
                for half, rows in enumerate(loaded_weight.chunk(2, dim=1)):
                    copy_weight(param.data.narrow(1, half * size, size), shard_of(rows, 1, self.tp_rank, self.tp_size))
            else:
                copy_weight(param.data, shard_of(loaded_weight, 2, self.tp_rank, self.tp_size))
            return
        expert, half = shard_id
        if param is self.w13_weight:
            copy_weight(param.data[expert].narrow(0, half * size, size),
                        shard_of(loaded_weight, 0, self.tp_rank, self.tp_size))
        else:
            copy_weight(param.data[expert], shard_of(loaded_weight, 1, self.tp_rank, self.tp_size))

    def quantize_fp8(self, device: torch.device) -> None:
        """`quantization="fp8"`: each expert's weights, moved to `device` (from host memory: `weights_on_host`),
        to float8_e4m3fn with one scale per output row, as the linear layers' (a down row's scale is the whole
        row's under tensor parallelism)."""
        if self.w13_scale is not None:
            raise RuntimeError("FusedMoE: the experts are fp8 already")
        for name, rows_split in (("w13", False), ("w2", True)):
            q, scale = quantize_experts(getattr(self, f"{name}_weight").data.to(device), rows_split)
            setattr(self, f"{name}_weight", nn.Parameter(q, requires_grad=False))
            setattr(self, f"{name}_scale", scale)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's part of each token's weighted expert sum [T, H] (the all-reduce adds the ranks' parts), or
        with `residual` (one rank) the residual stream with the sum added in place."""
        return fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, residual, self.w13_scale,
                         self.w2_scale)


class SparseMoeBlock(nn.Module):
    """residual + MoE(RMSNorm(residual)): a decoder layer's `mlp` (Mixtral's checkpoints call it
    `block_sparse_moe`). Module names mirror the checkpoints' (`gate`, `experts`)."""

    def __init__(self, config: Any, all_reduce_slot: int, shared_expert: nn.Module | None = None) -> None:
        """shared_expert: Qwen2-MoE's dense MLP that every token goes through, its output scaled by
        sigmoid(x g^T) (`shared_expert_gate`) and added to the experts'; it has `partial(hidden, norm)` and
        `fold_norm(weight)`, as the decoder's MLP (models/llama.py)."""
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for MoE experts; only 'silu'")
        num_experts = num_experts_of(config)
        self.top_k = config.num_experts_per_tok
        if not 1 <= self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be between 1 and the number of experts "
                             f"({num_experts})")
        mixtral = config.model_type == "mixtral"
        # Mixtral always renormalises the top-k weights; Qwen's MoE models where `norm_topk_prob` says so.
        self.renormalize = mixtral or bool(getattr(config, "norm_topk_prob", False))
        intermediate = config.intermediate_size if mixtral else config.moe_intermediate_size
        self.gate = Router(config.hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, config.hidden_size, intermediate,
                                ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj"))
        self.all_reduce_slot = all_reduce_slot
        self.shared_expert = shared_expert
        self.shared_expert_gate = None if shared_expert is None else Router(config.hidden_size, 1)

    def fold_norm(self, norm_weight: torch.Tensor) -> None:
        """The input norm's weight into the shared expert's first projection, as a dense MLP's (it reads the
        residual stream; the router and the experts read the normalised one)."""
        if self.shared_expert is not None:
            self.shared_expert.fold_norm(norm_weight)

    def forward(self, hidden: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """The residual stream `hidden` plus the experts' output for its RMSNorm `norm` (the decoder layer's)."""
        x = norm(hidden)
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        shared = None
        if self.shared_expert is not None:
            shared = self.shared_expert.partial(hidden, norm) * torch.sigmoid(self.shared_expert_gate(x))
        if self.experts.tp_size == 1:
            if shared is not None:
                hidden.add_(shared)
            return self.experts(x, topk_weights, topk_ids, residual=hidden)
        partial = self.experts(x, topk_weights, topk_ids)
        return reduce_partial(partial if shared is None else partial.add_(shared), hidden, self.all_reduce_slot)
