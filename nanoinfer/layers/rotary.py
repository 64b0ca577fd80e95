"""Rotary position embedding (neox layout: the head's two halves rotate as
pairs). The cos/sin table for every position is built once at start-up and
indexed by `positions`, so forward is a gather plus elementwise math."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from nanoinfer.layers.fusion import fused
from nanoinfer.layers.layernorm import RMSNorm, rms_norm_math

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def get_rope_parameters(hf_config: Any) -> dict[str, Any]:
    """One dict with `rope_theta` and `rope_type` (plus scaling keys), whichever form the config uses:
    transformers 5 keeps everything in `rope_parameters`; 4.x has `rope_theta` and `rope_scaling`."""
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = {**(getattr(hf_config, "rope_scaling", None) or {}), "rope_theta": getattr(hf_config, "rope_theta", 10000.0)}
    # Old configs spell the type as "type"; no type means plain RoPE.
    return {**params, "rope_type": params.get("rope_type", params.get("type")) or "default"}


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 context extension: long wavelengths are slowed by `factor`, short ones kept,
    and the band in between interpolated linearly in 1/wavelength."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    original_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def _yarn(inv_freq: torch.Tensor, params: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN context extension (Qwen2.5 / Qwen3 past their native context, DeepSeek): (inv_freq, attention factor).
    Dimensions that turn fewer than `beta_slow` times over the original context are interpolated (their frequency
    divided by `factor`), those that turn more than `beta_fast` times are kept, with a linear ramp between (in
    dimension index); cos and sin are then scaled by the attention factor, 0.1 ln(factor) + 1 unless the config
    gives it (or `mscale` / `mscale_all_dim`), which keeps the softmax's sharpness over the longer context."""
    head_dim, base = 2 * len(inv_freq), params["rope_theta"]
    original = params.get("original_max_position_embeddings") or max_position
    factor = params.get("factor") or max_position / original

    def dim_turning(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` times in `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(params.get("beta_fast") or 32), dim_turning(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    kept = 1 - ((torch.arange(head_dim // 2, dtype=torch.float) - low) / ((high - low) or 1e-3)).clamp(0, 1)
    inv_freq = inv_freq / factor * (1 - kept) + inv_freq * kept

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        weight, weight_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, weight) / mscale(factor, weight_all) if weight and weight_all else mscale(factor)
    return inv_freq, float(attention)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope_parameters: dict[str, Any]) -> None:
        super().__init__()
        rope_type = rope_parameters["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"partial rotary embeddings (partial_rotary_factor="
                             f"{rope_parameters['partial_rotary_factor']}) are not supported")
        self.head_dim = head_dim
        inv_freq = 1.0 / (rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        attention = 1.0  # scales cos and sin (YaRN)
        if rope_type == "linear":  # positions divided by `factor`: the same as frequencies divided
            inv_freq = inv_freq / rope_parameters["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_parameters)
        elif rope_type == "yarn":
            inv_freq, attention = _yarn(inv_freq, rope_parameters, max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)  # [max_position, head_dim / 2]
        self.register_buffer("cos_cache", freqs.cos() * attention, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * attention, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; query/key: [T, heads * head_dim] -> rotated, same shapes (math in float32)."""
        return apply_rotary(positions, query, key, self.cos_cache, self.sin_cache, self.head_dim)

    def forward_with_qk_norm(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                             q_norm: RMSNorm, k_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3: RMSNorm over each query and each key head, then rotate (the PyTorch attention
        backend's path; the Triton backend does this and the KV write in one kernel,
        kernels/rotate_and_cache.py)."""
        return norm_heads_and_rotate(positions, query, key, q_norm.weight, k_norm.weight, q_norm.eps,
                                     self.cos_cache, self.sin_cache, self.head_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    shape = x.shape
    x1, x2 = x.view(shape[0], -1, head_dim).float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype).view(shape)


def _rotate_query_and_key(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_cache: torch.Tensor,
                          sin_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos_cache[positions].unsqueeze(1)
    sin = sin_cache[positions].unsqueeze(1)
    return _rotate(query, cos, sin, head_dim), _rotate(key, cos, sin, head_dim)


apply_rotary = fused(_rotate_query_and_key)


@fused
def norm_heads_and_rotate(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor,
                          k_weight: torch.Tensor, eps: float, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                          head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    query = rms_norm_math(query.reshape(-1, head_dim), q_weight, eps).view(query.shape)
    key = rms_norm_math(key.reshape(-1, head_dim), k_weight, eps).view(key.shape)
    return _rotate_query_and_key(positions, query, key, cos_cache, sin_cache, head_dim)


def get_rope(head_dim: int, max_position: int, hf_config: Any) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, max_position, get_rope_parameters(hf_config))
