"""From engine arguments to what the engine needs to start: a folder of
weights (GGUF converted and cached), its HF config, a tokenizer location,
the context length and the token ids that end generation."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from nanoinfer.config import EngineConfig


@dataclass
class ModelSource:
    model_path: str  # a folder, or a config.json file for dummy weights
    hf_config: object
    tokenizer_path: str | None
    max_model_len: int
    eos_token_ids: set[int]


def _as_folder(path: str) -> str:
    """GGUF files become cached HF folders; everything else is used as given."""
    if path.endswith(".gguf"):
        from nanoinfer.loader.gguf import resolve_gguf

        return resolve_gguf(path)
    return path


def _has_tokenizer(folder: str) -> bool:
    return os.path.isdir(folder) and any(
        os.path.exists(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _eos_ids(value, source: str) -> set[int]:
    if value is None:
        return set()
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{source}: eos_token_id must be a token id or a list of them, got {value!r:.80}")
    return set(values)


def _positive_int(hf_config, name: str, default=None) -> int:
    value = getattr(hf_config, name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"the model's config.json: {name} must be a positive integer, got {value!r}")
    return value


def check_model_config(hf_config) -> None:
    """The sizes every supported architecture reads, checked before anything is built from them (a zero or
    a mismatch would otherwise fail deep inside the model, or at the first step)."""
    from nanoinfer.layers.rotary import get_rope_parameters

    for name in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        _positive_int(hf_config, name)
    num_heads = hf_config.num_attention_heads
    num_kv_heads = _positive_int(hf_config, "num_key_value_heads", num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"the model's config.json: num_key_value_heads={num_kv_heads} must divide "
                         f"num_attention_heads={num_heads}")
    if getattr(hf_config, "max_position_embeddings", None) is not None:
        _positive_int(hf_config, "max_position_embeddings")
    for name, value in (("rope_theta", get_rope_parameters(hf_config).get("rope_theta")),
                        ("rms_norm_eps", getattr(hf_config, "rms_norm_eps", None))):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"the model's config.json: {name} must be a positive number, got {value!r}")


def resolve_model(config: EngineConfig) -> ModelSource:
    from nanoinfer.loader.weights import get_hf_config
    from nanoinfer.models.registry import get_model_class

    if config.model is None:
        from nanoinfer.loader.default_model import default_model_path

        model_path = default_model_path()
    else:
        if not os.path.exists(config.model):
            raise FileNotFoundError(f"model path {config.model!r} does not exist (models load from local folders, "
                                    f".gguf files, or a config.json with load_format='dummy')")
        if config.load_format == "gguf" and not config.model.endswith(".gguf"):
            raise ValueError(f"load_format='gguf' needs a .gguf file, got {config.model!r}")
        model_path = _as_folder(config.model)
    hf_config = get_hf_config(model_path)
    get_model_class(hf_config)  # an unsupported architecture fails here, before anything is built
    check_model_config(hf_config)

    if config.tokenizer and not os.path.exists(config.tokenizer):
        raise FileNotFoundError(f"tokenizer path {config.tokenizer!r} does not exist (tokenizers load from local "
                                f"folders or .gguf files)")
    tokenizer_path = _as_folder(config.tokenizer) if config.tokenizer else None
    if tokenizer_path is None and _has_tokenizer(model_path):
        tokenizer_path = model_path

    model_max = getattr(hf_config, "max_position_embeddings", None) or 2048
    max_model_len = config.max_model_len or model_max
    if max_model_len > model_max:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={model_max}")

    eos = _eos_ids(getattr(hf_config, "eos_token_id", None), "config.json")
    gen_config = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(gen_config):
        try:
            with open(gen_config) as f:
                generation = json.load(f)
        except ValueError as e:
            raise ValueError(f"{gen_config} is not valid JSON: {e}") from None
        if not isinstance(generation, dict):
            raise ValueError(f"{gen_config} must hold a JSON object, got {type(generation).__name__}")
        eos |= _eos_ids(generation.get("eos_token_id"), gen_config)
    return ModelSource(model_path, hf_config, tokenizer_path, max_model_len, eos)
