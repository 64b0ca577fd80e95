"""From engine arguments to what the engine needs to start: a folder of
weights (GGUF converted and cached), its HF config, a tokenizer location,
the context length and the token ids that end generation."""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field

from nanoinfer.config import EngineConfig
from nanoinfer.pooling_params import PoolerConfig

logger = logging.getLogger("nanoinfer")


@dataclass
class ModelSource:
    model_path: str  # a folder, or a config.json file for dummy weights
    hf_config: object
    tokenizer_path: str | None
    max_model_len: int
    eos_token_ids: set[int]
    # SamplingParams fields the model's creators recommend (generation_config.json): what a request leaves unset
    # takes from here (EngineConfig.generation_config).
    default_sampling: dict = field(default_factory=dict)
    pooler: PoolerConfig | None = None  # runner="pooling": how hidden states become embeddings (resolved once)
    # The commits Hub names resolved to ("revision", "tokenizer_revision"): the other tensor-parallel ranks load these
    hub_revisions: dict[str, str] = field(default_factory=dict)


# generation_config.json's sampling fields, as vLLM reads them (`--generation-config auto`), and SamplingParams' names.
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                      "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


# What the engine reads of a Hugging Face Hub repository: configs, tokenizer files, chat templates, sentence-
# transformers settings and, where weights are loaded, the safetensors shards (without Mistral's consolidated copy
# of them, which the loader skips too).
_HUB_FILES = ["*.json", "*.model", "*.txt", "*.jinja"]
_HUB_WEIGHTS = ["*.safetensors"]
_HUB_SKIPPED = ["consolidated*"]
_REPO_ID = re.compile(r"[\w-][\w.-]*/[\w-][\w.-]*")


def local_path(path: str, what: str, revision: str | None = None, download_dir: str | None = None,
               weights: bool = False) -> str:
    """`path` itself when it exists; otherwise a Hugging Face Hub repository id ("org/name", as vLLM takes a model
    name) fetched into the hub's cache (`download_dir`, default ~/.cache/huggingface) or, offline
    (HF_HUB_OFFLINE=1), found there: its snapshot folder, named by its commit. Safetensors weights only with
    `weights` (a tokenizer, or dummy weights, need none)."""
    if os.path.exists(path):
        return path
    if not _REPO_ID.fullmatch(path):
        forms = ".gguf files, a config.json with load_format='dummy'" if what == "model" else ".gguf files"
        raise FileNotFoundError(f"{what} path {path!r} does not exist ({what}s load from local folders, {forms}, or "
                                f"Hugging Face Hub names: org/name)")
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(path, revision=revision, cache_dir=download_dir, ignore_patterns=_HUB_SKIPPED,
                                   allow_patterns=_HUB_FILES + (_HUB_WEIGHTS if weights else []))
    except Exception as e:  # unknown repository, no network and not in the cache, a gated model, ...
        raise FileNotFoundError(f"{what} path {path!r} does not exist, and as a Hugging Face Hub repository it "
                                f"could not be fetched or found in the cache ({type(e).__name__}: {e})") from None
    logger.info("%s %s%s: %s", what, path, f"@{revision}" if revision else "", folder)
    return folder


def _as_folder(path: str) -> str:
    """GGUF files become cached HF folders; everything else is used as given."""
    if path.lower().endswith(".gguf"):
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
    from nanoinfer.layers.moe import num_experts_of
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
    for name in ("num_experts", "num_local_experts"):  # (0 or absent: a dense model)
        value = getattr(hf_config, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"the model's config.json: {name} must be a non-negative integer, got {value!r}")
    if num_experts_of(hf_config):  # a mixture of experts (layers/moe.py)
        for name in ("num_experts_per_tok", "decoder_sparse_step", "shared_expert_intermediate_size"):
            if getattr(hf_config, name, None) is not None:
                _positive_int(hf_config, name)
        if hf_config.model_type != "mixtral":
            _positive_int(hf_config, "moe_intermediate_size")
    for name, value in (("rope_theta", get_rope_parameters(hf_config).get("rope_theta")),
                        ("rms_norm_eps", getattr(hf_config, "rms_norm_eps", None))):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"the model's config.json: {name} must be a positive number, got {value!r}")


def resolve_model(config: EngineConfig) -> ModelSource:
    from nanoinfer.loader.weights import get_hf_config
    from nanoinfer.models.registry import get_model_class

    hub_revisions: dict[str, str] = {}
    if config.model is None:
        from nanoinfer.loader.default_model import default_model_path

        model_path = default_model_path()
    else:
        if config.load_format == "gguf" and not config.model.lower().endswith(".gguf"):
            raise ValueError(f"load_format='gguf' needs a .gguf file, got {config.model!r}")
        model_path = _as_folder(local_path(config.model, "model", config.revision, config.download_dir,
                                           weights=config.load_format != "dummy"))
        if not os.path.exists(config.model):  # a Hub name: its snapshot folder is named by the commit it resolved to
            hub_revisions["revision"] = os.path.basename(model_path)
    hf_config = get_hf_config(model_path)
    get_model_class(hf_config)  # an unsupported architecture fails here, before anything is built
    check_model_config(hf_config)

    tokenizer_path = _as_folder(local_path(config.tokenizer, "tokenizer", config.tokenizer_revision,
                                           config.download_dir)) if config.tokenizer else None
    if tokenizer_path is not None and not os.path.exists(config.tokenizer):
        hub_revisions["tokenizer_revision"] = os.path.basename(tokenizer_path)
    if tokenizer_path is None and _has_tokenizer(model_path):
        tokenizer_path = model_path

    model_max = getattr(hf_config, "max_position_embeddings", None) or 2048
    max_model_len = config.max_model_len or model_max
    if max_model_len > model_max:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={model_max}")
    # Qwen2/3 keep a `sliding_window` value even when `use_sliding_window` is off. Within one window attention is
    # full, so a context no longer than the window needs none.
    window = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", True) else None
    if window is not None and window < max_model_len:
        raise ValueError(f"sliding-window attention (sliding_window={window}) is not supported: give max_model_len "
                         f"<= {window}, within which attention is full")

    eos = _eos_ids(getattr(hf_config, "eos_token_id", None), "config.json")
    generation = _generation_config(model_path)
    if generation is not None:
        eos |= _eos_ids(generation.get("eos_token_id"), os.path.join(model_path, "generation_config.json"))
    pooler = PoolerConfig.resolve(model_path, hf_config, config.pooler_config) if config.runner == "pooling" else None
    return ModelSource(model_path, hf_config, tokenizer_path, max_model_len, eos,
                       _default_sampling(config.generation_config, model_path, generation), pooler, hub_revisions)


def _generation_config(folder: str) -> dict | None:
    """The folder's generation_config.json, if it has one."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            generation = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(generation, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(generation).__name__}")
    return generation


def _default_sampling(option: str, model_path: str, generation: dict | None) -> dict:
    """The sampling defaults `option` names: the model folder's generation_config.json ("auto"), none ("vllm"),
    or another folder's; checked as SamplingParams would check them."""
    from nanoinfer.sampling_params import SamplingParams

    if option == "vllm":
        return {}
    if option != "auto":
        if not os.path.isdir(option):
            raise FileNotFoundError(f"generation_config {option!r} is not 'auto', 'vllm' or a folder")
        generation = _generation_config(option)
        if generation is None:
            raise FileNotFoundError(f"generation_config: {option!r} holds no generation_config.json")
        model_path = option
    defaults = {name: generation[key] for key, name in GENERATION_FIELDS.items()
                if (generation or {}).get(key) is not None}  # null: no recommendation (as vLLM reads it)
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{os.path.join(model_path, 'generation_config.json')}: {e}") from None
    if defaults:
        logger.info("default sampling parameters from %s (requests that leave them unset take them; "
                    "generation_config='vllm' ignores them): %s", os.path.join(model_path, "generation_config.json"),
                    defaults)
    return defaults
