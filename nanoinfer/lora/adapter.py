"""A PEFT LoRA adapter folder (`adapter_config.json` + `adapter_model.safetensors`), read and checked against
the base model before any request that names it is admitted, so a bad adapter is the caller's error and never
reaches a step.

An adapter adds `scaling * B A x` to a projection's output, A: [r, in_features], B: [out_features, r], with
scaling `lora_alpha / r` (`lora_alpha / sqrt(r)` under rsLoRA). The projections it may adapt are the decoder's
seven (q/k/v/o, gate/up/down); weights of the embedding or the LM head, DoRA, LoRA biases and per-module ranks
are refused with the reason."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from nanoinfer.layers.moe import is_moe_layer

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT's tensor names: base_model.model.<the model's module>.lora_A.weight (the adapter name is not saved).
_TENSOR_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_MAX_CONFIG_BYTES = 1 << 20
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def target_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection an adapter may target, as the checkpoint holds it."""
    hidden, heads, kv_heads = hf_config.hidden_size, hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter folder's weights, checked: {(layer, projection): (A, scaling * B)} in float32 on the CPU."""

    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def load(cls, path: str, hf_config: Any, max_rank: int, dtype: torch.dtype | None = None) -> "LoRAAdapter":
        """Read and check the folder (ValueError says what is wrong). Every check runs on the tensors returned, so
        what admission checked is what a slot receives even if the files changed in between. `dtype`: the model's,
        where the scaled weights must stay finite too (float16 holds up to 65,504); without it, float32."""
        config = _read_config(path)
        rank = config.get("r", 8)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"LoRA adapter {path}: r must be a positive integer, got {rank!r}")
        if rank > max_rank:
            raise ValueError(f"LoRA adapter {path} has rank {rank}, more than max_lora_rank={max_rank} (start the "
                             f"engine with max_lora_rank >= {rank}, the server with --max-lora-rank {rank})")
        alpha = config.get("lora_alpha", 8)
        try:
            if isinstance(alpha, bool) or not math.isfinite(alpha):
                raise TypeError
            scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        except (TypeError, OverflowError):
            raise ValueError(f"LoRA adapter {path}: lora_alpha must be a finite number, got {alpha!r:.40}") from None
        weights = {key: (a, b * scaling) for key, (a, b) in _read_weights(path, hf_config, rank).items()}
        for (layer, module), pair in weights.items():
            if not all(torch.isfinite(t.to(dtype or torch.float32)).all() for t in pair):
                raise ValueError(f"LoRA adapter {path}: layer {layer}'s {module} has weights that are not finite "
                                 f"(NaN or infinite{'' if dtype is None else f' in {dtype}'}, scaling {scaling:g} "
                                 f"included)")
        return cls(path, rank, weights)


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {path!r} is not a folder (it should hold {ADAPTER_CONFIG} and "
                         f"{ADAPTER_WEIGHTS})")
    config_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(config_path):  # (a regular file: a FIFO or a device would block or never end)
        raise ValueError(f"LoRA adapter {path}: no {ADAPTER_CONFIG} file")
    if os.path.getsize(config_path) > _MAX_CONFIG_BYTES:
        raise ValueError(f"LoRA adapter {path}: {ADAPTER_CONFIG} is over {_MAX_CONFIG_BYTES} bytes")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"LoRA adapter {path}: {ADAPTER_CONFIG} could not be read: {type(e).__name__}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {path}: {ADAPTER_CONFIG} is not a JSON object")
    refused = [
        (config.get("peft_type", "LORA") != "LORA", f"peft_type {config.get('peft_type')!r} (only LORA is served)"),
        (bool(config.get("use_dora")), "use_dora (DoRA's magnitude vectors are not applied)"),
        (config.get("bias", "none") != "none", f"bias={config.get('bias')!r} (LoRA bias terms are not applied)"),
        (bool(config.get("modules_to_save")), f"modules_to_save {config.get('modules_to_save')!r} (fully trained "
                                               f"modules are not loaded)"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (transposed weights of GPT-2's Conv1D)"),
        (bool(config.get("rank_pattern")) or bool(config.get("alpha_pattern")),
         "rank_pattern / alpha_pattern (per-module ranks and scalings)"),
    ]
    for is_set, what in refused:
        if is_set:
            raise ValueError(f"LoRA adapter {path} uses {what}, which nanoinfer does not support")
    return config


def _read_weights(path: str, hf_config: Any, rank: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """{(layer, projection): (A, B)} in float32, each name, dtype and shape checked, A and B in pairs."""
    from safetensors.torch import load_file

    weights = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights):
        pickled = os.path.isfile(os.path.join(path, "adapter_model.bin"))
        raise ValueError(f"LoRA adapter {path}: no {ADAPTER_WEIGHTS} file" + (
            " (its adapter_model.bin is a pickle, which nanoinfer never loads: save the adapter with "
            "safe_serialization=True)" if pickled else ""))
    try:
        tensors = load_file(weights)
    except Exception as e:  # a damaged file: safetensors' own errors
        raise ValueError(f"LoRA adapter {path}: {ADAPTER_WEIGHTS} could not be read: {e}") from None
    shapes = target_shapes(hf_config)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.match(name)
        if match is None or match.group(3) not in shapes or _PARENT[match.group(3)] != match.group(2):
            raise ValueError(f"LoRA adapter {path}: tensor {name!r} adapts a module nanoinfer does not "
                             f"(supported: the decoder layers' {', '.join(shapes)})")
        layer, parent, module, which = match.groups()
        if int(layer) >= hf_config.num_hidden_layers:
            raise ValueError(f"LoRA adapter {path}: tensor {name!r} is for layer {layer}; the model has "
                             f"{hf_config.num_hidden_layers}")
        if parent == "mlp" and is_moe_layer(hf_config, int(layer)):
            raise ValueError(f"LoRA adapter {path}: tensor {name!r} adapts layer {layer}'s MLP, which is a mixture of "
                             f"experts here: adapters on MoE experts are not supported (attention projections are)")
        if not tensor.is_floating_point():
            raise ValueError(f"LoRA adapter {path}: tensor {name!r} holds {tensor.dtype}, not floating-point weights")
        in_features, out_features = shapes[module]
        expected = (rank, in_features) if which == "A" else (out_features, rank)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"LoRA adapter {path}: tensor {name!r} has shape {list(tensor.shape)}, expected "
                             f"{list(expected)} (rank {rank} on this model): was it trained for another model?")
        found.setdefault((int(layer), module), {})[which] = tensor.float()
    for (layer, module), pair in sorted(found.items()):
        if len(pair) != 2:
            raise ValueError(f"LoRA adapter {path}: layer {layer}'s {module} has lora_{'A' if 'B' in pair else 'B'} "
                             f"missing")
    if not found:
        raise ValueError(f"LoRA adapter {path}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    return {key: (pair["A"], pair["B"]) for key, pair in found.items()}


def admission_registry(config: Any, hf_config: Any) -> "LoRARegistry | None":
    """The adapters an engine's admission checks: a registry when config.enable_lora, else None. Their weights must
    be finite in float16 where the engine may run in it (config.dtype, or the model's own for "auto" on a GPU)."""
    from nanoinfer.engine.core import gpu_dtype  # (the engine's own choice; imported here: the core imports this)

    if not config.enable_lora:
        return None
    fp16 = gpu_dtype(config, hf_config) == torch.float16
    return LoRARegistry(hf_config, config.max_lora_rank, torch.float16 if fp16 else None)


class LoRARegistry:
    """Admission's adapters: each checked against the model once (`LoRAAdapter.load`), and each id standing for
    one adapter: the same id with another name or folder is refused, since the id keys the runner's slots and
    the prefix cache."""

    def __init__(self, hf_config: Any, max_lora_rank: int, dtype: torch.dtype | None = None) -> None:
        """`dtype`: float16 where the model may run in it (its weights must stay finite there), else None."""
        self.hf_config, self.max_lora_rank, self.dtype = hf_config, max_lora_rank, dtype
        self.known: dict[int, Any] = {}  # lora_int_id -> the LoRARequest that registered it

    def forget(self, lora_int_id: int) -> None:
        """An adapter the server unloaded (its ids are never used again)."""
        self.known.pop(lora_int_id, None)

    def check(self, request: Any) -> None:
        known = self.known.get(request.lora_int_id)
        if known is None:
            LoRAAdapter.load(request.lora_path, self.hf_config, self.max_lora_rank, self.dtype)
            self.known[request.lora_int_id] = request
        elif (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
            raise ValueError(f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} ({known.lora_path}) "
                             f"in this engine; {request.lora_name!r} ({request.lora_path}) needs an id of its own")
