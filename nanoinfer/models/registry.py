"""Maps the `architectures` entry of an HF config to our implementation."""

from __future__ import annotations

from typing import Any

from torch import nn

from nanoinfer.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    # Bare-model exports, as embedding models ship (runner="pooling"): the same layers without an LM head.
    "LlamaModel": LlamaForCausalLM,
    "MistralModel": LlamaForCausalLM,
    "Qwen2Model": LlamaForCausalLM,
    "Qwen3Model": LlamaForCausalLM,
}


def get_model_class(hf_config: Any) -> type[nn.Module]:
    architectures = getattr(hf_config, "architectures", None) or []
    for name in architectures:
        if name in _MODELS:
            return _MODELS[name]
    raise ValueError(
        f"unsupported model architecture {architectures}; supported: {', '.join(sorted(_MODELS))}"
    )
