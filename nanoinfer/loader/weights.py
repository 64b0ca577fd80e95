"""Builds a model and fills its weights: from a Hugging Face folder of
`*.safetensors` files, or with small random values (`dummy`, for benchmarks
and tests without a checkpoint).

Loading streams one checkpoint tensor at a time; each parameter's
`weight_loader` copies only this rank's shard into place, so with tensor
parallelism no rank holds the full model. Dummy weights take the same path
with generated checkpoint tensors, so every TP size sees the same model.
Every name is checked before anything is read: a missing or unexpected
weight fails fast, naming it. An fp8 checkpoint's weights are dequantized
as they are read (their scales are read with them); `quantization="fp8"`
quantizes the model once its weights are processed (layers/fp8.py), and on
a GPU builds its projections' and MoE experts' weights in host memory until then.
"""

from __future__ import annotations

import json
import logging
import zlib
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from nanoinfer.layers import fp8
from nanoinfer.layers.linear import LinearBase, default_weight_loader
from nanoinfer.layers.moe import FusedMoE
from nanoinfer.models.registry import get_model_class

logger = logging.getLogger("nanoinfer")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
DUMMY_SEED = 0
_SAFETENSORS_INDEX = "model.safetensors.index.json"


def _model_dir(model_path: str | Path) -> Path:
    path = Path(model_path)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} is a file; expected a Hugging Face model folder")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {str(path)!r} has no config.json")
    return path


def get_hf_config(model_path: str | Path) -> Any:
    """The transformers config of a model folder, or of a bare config.json file (enough for dummy
    weights). Never touches the network."""
    from transformers import AutoConfig

    path = Path(model_path)
    if path.is_file() and path.suffix != ".json":
        raise ValueError(f"model path {str(path)!r} is neither a model folder nor a config .json file")
    source = path if path.is_file() else _model_dir(path)
    try:
        return AutoConfig.from_pretrained(str(source), local_files_only=True)
    except Exception as e:  # transformers raises many types for a malformed config
        raise ValueError(f"cannot read the model config at {str(source)!r}: {e}") from e


def _safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint files: those listed by the shard index if there is one; else `model.safetensors`;
    else every `*.safetensors` (the index or `model.safetensors` wins over stray files such as
    Mistral's `consolidated.safetensors`, which holds the same weights under other names)."""
    index = folder / _SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
            if not all(isinstance(n, str) for n in names):
                raise TypeError("its weight_map values must be file names")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a valid shard index ({type(e).__name__}: {e}); it needs "
                             f"{{\"weight_map\": {{tensor name: shard file name}}}}") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shard files that are missing: {missing}")
        return [folder / n for n in names]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        hint = f" (found {others}; only safetensors is supported)" if others else ""
        raise FileNotFoundError(f"model folder {str(folder)!r} has no *.safetensors weights{hint}")
    return files


def _checkpoint_targets(model: nn.Module, found: set[str] | None = None) -> dict[str, tuple[nn.Parameter, Any]]:
    """Checkpoint tensor name -> (our parameter, shard_id). A fused parameter such as
    `...self_attn.qkv_proj.weight` is the target of `...q_proj.weight` (shard "q") etc. A parameter that lists
    its own `checkpoint_names` (alternative namings, each relative to its module: the MoE experts' one tensor per
    expert, or transformers 5's stacked tensors) is the target of the naming the checkpoint's names `found` use
    (the first where none does; every naming where `found` is None). A tied LM head shares the embedding
    parameter, so only the embedding is expected."""
    packed = getattr(model, "packed_modules_mapping", {})
    targets: dict[str, tuple[nn.Parameter, Any]] = {}
    for name, param in model.named_parameters():
        module_path, _, leaf = name.rpartition(".")
        namings = getattr(param, "checkpoint_names", None)
        if namings is not None:
            full = [{f"{module_path}.{relative}": shard_id for relative, shard_id in naming.items()}
                    for naming in namings]
            used = full if found is None else [naming for naming in full if naming.keys() & found] or full[:1]
            if found is not None and len(used) > 1:
                raise ValueError(f"the checkpoint holds {name} twice, in two layouts: "
                                 f"{[min(naming) for naming in used]}")
            targets.update({n: (param, shard_id) for naming in used for n, shard_id in naming.items()})
            continue
        parent, _, module_name = module_path.rpartition(".")
        prefix = f"{parent}." if parent else ""
        for checkpoint_module, shard_id in packed.get(module_name, [(module_name, None)]):
            targets[f"{prefix}{checkpoint_module}.{leaf}"] = (param, shard_id)
    return targets


def _our_names(model: nn.Module, names: list[str]) -> dict[str, str]:
    """Checkpoint tensor name -> the name the model loads it under: with the model's `checkpoint_substrings`
    replaced (Mixtral's checkpoints call its MoE block `block_sparse_moe`, which is our `mlp`, as transformers 5's),
    and an export of the bare model (sentence-transformers' and most embedding models': `layers.0...`) read under
    "model.". A name the model lacks stays as it is, for the match to report. Two checkpoint names for one tensor
    are an error (one would silently overwrite the other)."""
    own = _checkpoint_targets(model)
    ours: dict[str, str] = {}
    for name in names:
        mapped = name
        for old, new in getattr(model, "checkpoint_substrings", {}).items():
            mapped = mapped.replace(old, new)
        ours[name] = f"model.{mapped}" if mapped not in own and f"model.{mapped}" in own else mapped
    first: dict[str, str] = {}
    for name, mapped in ours.items():
        if mapped in first:
            renamed, other = sorted((first[mapped], name), key=lambda n: n == mapped)
            raise ValueError(f"tensor {mapped!r} is in the checkpoint twice: as {renamed!r} and {other!r}")
        first[mapped] = name
    return ours


def _is_kv_cache_scale(name: str) -> bool:
    """A quantized checkpoint's KV-cache scales (compressed-tensors' `self_attn.k_scale` / `v_scale`, older
    `kv_scale`, or `k_proj.output_scale` / `v_proj.output_scale`)."""
    module, _, leaf = name.rpartition(".")
    return leaf in ("k_scale", "v_scale", "kv_scale") or (
        leaf == "output_scale" and module.endswith(("k_proj", "v_proj")))


def _is_ignored(name: str, hf_config: Any) -> bool:
    """Checkpoint tensors we do not need: old Llama exports store RoPE's inv_freq, some
    tied-embedding checkpoints store a copy of the embedding as lm_head, and quantized checkpoints
    may store KV-cache scales (the cache here is the model's dtype, or with kv_cache_dtype="fp8"
    unscaled, as vLLM's default scale of 1)."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if _is_kv_cache_scale(name) and getattr(hf_config, "quantization_config", None) is not None:
        return True
    return name == "lm_head.weight" and getattr(hf_config, "tie_word_embeddings", False)


def _match_names(model: nn.Module, found: set[str], source: str, optional: frozenset[str] = frozenset()
                 ) -> dict[str, tuple[nn.Parameter, Any]]:
    """The load targets, once the checkpoint's names are known to be exactly the model's (`optional` ones may
    be missing)."""
    targets = _checkpoint_targets(model, found)
    missing, unexpected = sorted(targets.keys() - found - optional), sorted(found - targets.keys())
    if missing or unexpected:
        raise ValueError(
            f"{source} does not match {type(model).__name__}: "
            f"missing weights {_some(missing)}, unexpected weights {_some(unexpected)}"
        )
    return targets


def _some(names: list[str], shown: int = 20) -> str:
    """The first `shown` names (an MoE model's experts alone are thousands)."""
    return str(names) if len(names) <= shown else f"{names[:shown]} and {len(names) - shown} more"


def _load_tensor(targets: dict[str, tuple[nn.Parameter, Any]], name: str, loaded: torch.Tensor) -> None:
    """Copy this rank's shard of the full checkpoint tensor `name` into its parameter."""
    param, shard_id = targets[name]
    if not loaded.dtype.is_floating_point:  # an integer copy would load silently as garbage
        raise ValueError(f"checkpoint tensor {name!r} is {loaded.dtype}: weights must be floating point "
                         f"(of quantized checkpoints, only fp8 ones load)")
    if loaded.element_size() == 1:  # float8 values without their scales would load silently wrong
        raise ValueError(f"checkpoint tensor {name!r} is {loaded.dtype}, but config.json has no fp8 "
                         f"quantization_config saying how to scale it")
    weight_loader = getattr(param, "weight_loader", default_weight_loader)
    try:
        weight_loader(param, loaded, shard_id)
    except (ValueError, RuntimeError, IndexError) as e:  # (IndexError: a shard of a tensor of too few dims)
        raise ValueError(
            f"cannot load checkpoint tensor {name!r} of shape {tuple(loaded.shape)} "
            f"into a parameter of shape {tuple(param.shape)}: {e}"
        ) from e


_STACKED_EXPERTS = ("gate_up_proj", "down_proj")  # transformers 5's stacked MoE experts (layers/moe.py)
_STACKED_SCALES = {f"{stacked}_{suffix}" for stacked in _STACKED_EXPERTS for suffix in ("scale_inv", "scale")}


def _is_scale(name: str) -> bool:
    """Whether checkpoint tensor `name` is named as an fp8 weight's scale (or a stacked experts tensor's)."""
    leaf = name.rpartition(".")[2]
    return leaf in fp8.SCALE_SUFFIXES or leaf in _STACKED_SCALES


def _refuse_stacked_fp8_experts(name: str) -> None:
    leaf = name.rpartition(".")[2]
    if leaf.removesuffix("_scale_inv").removesuffix("_scale") in _STACKED_EXPERTS:
        raise ValueError(f"fp8 checkpoint tensor {name!r}: MoE experts stacked in fp8 (transformers 5's layout "
                         f"without its legacy names) do not load; save the checkpoint with one tensor per expert "
                         f"(save_pretrained's default)")


class _Fp8Scales:
    """An fp8 checkpoint's scales (`<module>.weight_scale_inv` or `.weight_scale`, and the unused `.input_scale`):
    each float8 weight is dequantized with its own as it is read, and every weight scale must be used by one, so
    a scale beside a weight stored unquantized cannot be dropped unseen (an `input_scale` may sit beside any
    weight: it is not used)."""

    def __init__(self, names: set[str], where: dict[str, Path], hf_config: Any) -> None:
        """`names`: the checkpoint's scale tensors; `where`: every tensor's file, by name."""
        self.block = fp8.checkpoint_block_size(hf_config)
        self.names = names
        for name in self.names:
            _refuse_stacked_fp8_experts(name)
            if f"{name.rpartition('.')[0]}.weight" not in where:
                raise ValueError(f"fp8 checkpoint tensor {name!r} is the scale of a weight the checkpoint does not "
                                 f"hold ({name.rpartition('.')[0]}.weight)")
        self.used: set[str] = set()

    def dequantized(self, name: str, tensor: torch.Tensor, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The float8 checkpoint tensor `name` times its scale, in float32 (`read` reads another tensor)."""
        if tensor.dtype != fp8.FP8_DTYPE:
            raise ValueError(f"fp8 checkpoint tensor {name!r} is {tensor.dtype}: fp8 weights must be "
                             f"{fp8.FP8_DTYPE}")
        module, _, leaf = name.rpartition(".")
        _refuse_stacked_fp8_experts(name)
        if leaf != "weight":
            raise ValueError(f"fp8 checkpoint tensor {name!r} is float8, but only weights are quantized")
        found = [f"{module}.{s}" for s in ("weight_scale_inv", "weight_scale") if f"{module}.{s}" in self.names]
        if len(found) > 1:
            raise ValueError(f"fp8 checkpoint tensor {name!r} has two scales, {found}: which one applies is unknown")
        if not found:
            raise ValueError(f"fp8 checkpoint tensor {name!r} has no scale ({module}.weight_scale_inv or "
                             f"{module}.weight_scale) in the checkpoint")
        self.used.add(found[0])
        return fp8.dequantize_checkpoint_weight(name, tensor, read(found[0]), self.block)

    def check_all_used(self) -> None:
        unused = sorted(n for n in self.names - self.used if not n.endswith(".input_scale"))
        if unused:
            raise ValueError(f"fp8 checkpoint scales {_some(unused)} belong to weights that are not float8: a scale "
                             f"for a weight stored unquantized has no meaning")


def _load_safetensors(model: nn.Module, folder: Path, hf_config: Any, needs_lm_head: bool = True) -> None:
    """Every checkpoint tensor into its parameter. An export of the bare model (sentence-transformers' and most
    embedding models': `layers.0...`, no LM head) loads too, its names read under "model."; its LM head may be
    missing where nothing computes logits (`needs_lm_head` False: runner="pooling"). An fp8 checkpoint's
    float8 weights are dequantized with their scales as they are read (`_Fp8Scales`)."""
    files = _safetensors_files(folder)
    where: dict[str, Path] = {}
    kv_cache_scales = []
    for file in files:
        with _open_safetensors(file) as f:
            keys = list(f.keys())
        ignored = {n for n in keys if _is_ignored(n, hf_config)}
        kv_cache_scales += [n for n in keys if n in ignored and _is_kv_cache_scale(n)]
        for name in (n for n in keys if n not in ignored):
            if name in where:  # one would silently overwrite the other
                raise ValueError(f"tensor {name!r} is in two checkpoint files: {where[name].name} and {file.name}")
            where[name] = file
    if kv_cache_scales:
        logger.warning("the checkpoint's %d KV-cache scales (%s, ...) are not used: the KV cache holds the model's "
                       "dtype, or with kv_cache_dtype='fp8' unscaled values", len(kv_cache_scales), kv_cache_scales[0])
    scale_names = {n for n in where if _is_scale(n)}
    scales = None
    if fp8.resolve_quantization(None, hf_config) == "fp8":
        scales = _Fp8Scales(scale_names, where, hf_config)
    elif scale_names:
        raise ValueError(f"the checkpoint holds fp8 scales ({min(scale_names)!r}), but config.json has no fp8 "
                         f"quantization_config saying how to apply them")
    weights = [n for n in where if n not in scale_names]
    rename = _our_names(model, weights)
    targets = _match_names(model, set(rename.values()), f"checkpoint in {str(folder)!r}",
                           frozenset() if needs_lm_head else frozenset({"lm_head.weight"}))
    with ExitStack() as stack:
        handles = {file: stack.enter_context(_open_safetensors(file)) for file in files}

        def read(name: str) -> torch.Tensor:
            try:
                return handles[where[name]].get_tensor(name)
            except Exception as e:  # safetensors' own error type: a file cut short, a corrupt offset
                raise ValueError(f"{where[name]}: cannot read tensor {name!r}: {e}") from None

        for name in weights:
            tensor = read(name)
            if scales is not None and tensor.dtype.is_floating_point and tensor.element_size() == 1:
                tensor = scales.dequantized(name, tensor, read)
            _load_tensor(targets, rename[name], tensor)
    if scales is not None:
        scales.check_all_used()


@contextmanager
def _open_safetensors(file: Path) -> Iterator[Any]:
    """`safe_open`, its failures (a truncated or corrupt file, a folder in its place) as errors naming the file."""
    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError (not a ValueError) or an OSError
        raise ValueError(f"{file} is not a readable safetensors file: {e}") from None
    with handle as f:
        yield f


def _checkpoint_shapes(hf_config: Any) -> dict[str, torch.Size]:
    """Name -> full shape of each tensor a checkpoint of this model holds, read off transformers' own
    model built on the meta device (no memory, no weights), under the names its checkpoints use
    (transformers stacks MoE experts in memory and saves one tensor per expert)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(hf_config)
    state = reference.state_dict()
    try:  # transformers >= 5 keeps MoE experts stacked in memory; 4.x modules already bear the checkpoint names
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        pass
    else:
        state = revert_weight_conversion(reference, state)
    return {name: t.shape for name, t in state.items() if not _is_ignored(name, hf_config)}


def dummy_bounds(name: str, shape: torch.Size) -> tuple[float, float]:
    """The uniform range of one dummy tensor, scaled like a freshly initialised model: matrices
    ±sqrt(3 / fan_in) (unit-variance outputs), norm weights near one, biases near zero. Logits then
    spread over a few units, so greedy tokens compare code paths rather than rounding (with vLLM's
    ±1e-3 everywhere every logit is a near-tie)."""
    if name.endswith("norm.weight"):
        return 0.9, 1.1
    if len(shape) == 2:
        bound = (3.0 / shape[1]) ** 0.5
        return -bound, bound
    return -1e-2, 1e-2


def _fill_dummy(model: nn.Module, hf_config: Any, device: torch.device, seed: int = DUMMY_SEED) -> None:
    """Uniform values in `dummy_bounds`; no file is read. Each full checkpoint tensor comes from a
    generator seeded by `seed` and its name, then is sharded like a real one: the same model for
    every TP size (reproducible per device type and dtype)."""
    shapes = _checkpoint_shapes(hf_config)
    rename = _our_names(model, list(shapes))
    targets = _match_names(model, set(rename.values()),
                           f"dummy weights for {getattr(hf_config, 'architectures', None)}")
    generator = torch.Generator(device=device)
    for name, shape in shapes.items():
        generator.manual_seed(seed + zlib.crc32(name.encode()))
        full = torch.empty(shape, dtype=targets[rename[name]][0].dtype, device=device)
        _load_tensor(targets, rename[name], full.uniform_(*dummy_bounds(name, shape), generator=generator))


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_path: str | Path | None,
    hf_config: Any,
    load_format: str = "auto",
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    needs_lm_head: bool = True,
    quantization: str | None = None,
) -> nn.Module:
    """Build the architecture named by `hf_config` on `device` in `dtype` and load its weights (`auto` and
    `safetensors` read `model_path`; `dummy` needs no files). `quantization` ("fp8", from
    `fp8.resolve_quantization`): the decoder's projections and MoE experts then hold fp8 weights, their
    full-precision ones built on the host until each is quantized (`fp8.weights_on_host`)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; choose one of {LOAD_FORMATS}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    model_class = get_model_class(hf_config)
    folder = None
    if load_format != "dummy":
        if model_path is None:
            raise ValueError(f"load_format={load_format!r} needs a model_path; use load_format='dummy' to run without weights")
        folder = _model_dir(model_path)
    on_host = quantization == "fp8" and torch.device(device).type != "cpu"  # (the GPU never holds bf16 weights)
    with torch.device(device), _default_dtype(dtype), fp8.weights_on_host(on_host):
        model = model_class(hf_config)
    if folder is None:
        _fill_dummy(model, hf_config, torch.device(device))
    else:
        _load_safetensors(model, folder, hf_config, needs_lm_head)
    model.process_weights_after_loading()
    if quantization == "fp8":
        for name, module in model.named_modules():
            if isinstance(module, (LinearBase, FusedMoE)):
                try:
                    module.quantize_fp8(torch.device(device))
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None
    return model.eval()
