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


def _eos_ids(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


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

    tokenizer_path = _as_folder(config.tokenizer) if config.tokenizer else None
    if tokenizer_path is None and _has_tokenizer(model_path):
        tokenizer_path = model_path

    model_max = getattr(hf_config, "max_position_embeddings", None) or 2048
    max_model_len = config.max_model_len or model_max
    if max_model_len > model_max:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={model_max}")

    eos = _eos_ids(getattr(hf_config, "eos_token_id", None))
    gen_config = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(gen_config):
        with open(gen_config) as f:
            eos |= _eos_ids(json.load(f).get("eos_token_id"))
    return ModelSource(model_path, hf_config, tokenizer_path, max_model_len, eos)
