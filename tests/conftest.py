"""Shared fixtures: the embedded SmolLM2 folder and tiny random HF models."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from nanoinfer.loader.default_model import default_model_path

    return default_model_path()


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, initializer_range=0.2)


def make_tiny_model(path: str, arch: str, **overrides) -> str:
    """Save a tiny random transformers model (peaky logits: initializer_range 0.2) as safetensors."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }[arch]
    kwargs = dict(TINY, **overrides)
    if arch in ("qwen3", "qwen3_moe"):
        kwargs.setdefault("head_dim", 16)
    if arch == "qwen3_moe":  # 8 experts of 32, two per token; the default keeps every layer sparse
        kwargs = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, **kwargs}
    if arch == "qwen2_moe":  # 8 experts of 32, two per token, and a shared expert of 48
        kwargs = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48, **kwargs}
    if arch == "mixtral":  # 4 experts of intermediate_size, two per token; no EOS (its default, 2, is a plain token
        # here, which transformers' min_new_tokens would mask and our ignore_eos not)
        kwargs = {"num_local_experts": 4, "num_experts_per_tok": 2, "eos_token_id": None, "bos_token_id": None, **kwargs}
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs)).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(str(root / arch), arch) for arch in ("llama", "qwen2", "qwen3")}
