"""Turn a GGUF checkpoint into a Hugging Face style folder, once.

The rest of nanoinfer loads only HF folders (config.json + safetensors +
tokenizer), so a GGUF file is converted into one and cached: the weights are
dequantized to float32 (Q4_1/Q8_0 values are exact there, not in bf16) and the
llama.cpp-specific Q/K row permutation is undone.
"""

import glob
import json
import logging
import os
import re
import shutil
import tempfile

import gguf
import numpy as np
import xxhash
from safetensors.numpy import save_file
from transformers import CONFIG_MAPPING, AutoTokenizer, GenerationConfig

logger = logging.getLogger("nanoinfer")

# Written last inside a converted folder: its presence proves the folder is complete.
MARKER_FILE = "nanoinfer_gguf.json"

# GGUF architecture -> (HF architecture class, Q/K rows permuted by llama.cpp's convert).
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(.+)")

_REQUIRED = object()


def _check_file(gguf_path: str) -> None:
    if not os.path.exists(gguf_path):
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if not os.path.isfile(gguf_path):
        raise ValueError(f"GGUF path is not a file: {gguf_path}")


def _open(gguf_path: str) -> gguf.GGUFReader:
    """Open a GGUF file, turning the reader's low-level failures into one clear error."""
    _check_file(gguf_path)
    try:
        return gguf.GGUFReader(gguf_path)
    except Exception as e:  # the reader fails in many ways on junk (bad magic, truncation, bad offsets)
        raise ValueError(f"{gguf_path} is not a valid GGUF file: {e}") from e


def _field(reader: gguf.GGUFReader, key: str, default=_REQUIRED):
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"GGUF file {reader.data.filename} lacks the metadata key {key!r}")
        return default
    value = field.contents()
    if isinstance(value, float):  # GGUF stores float32: recover the decimal it came from (1e-05, not 9.99e-06)
        value = float(str(np.float32(value)))
    return value


def _architecture(reader: gguf.GGUFReader) -> str:
    arch = _field(reader, gguf.Keys.General.ARCHITECTURE)
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} of {reader.data.filename} is not supported "
            f"(supported: {', '.join(sorted(_ARCHITECTURES))})"
        )
    return arch


def _build_config(reader: gguf.GGUFReader, arch: str):
    """Map GGUF metadata onto the transformers config of the same architecture."""

    def meta(key: str, default=_REQUIRED):
        return _field(reader, key.format(arch=arch), default)

    if meta(gguf.Keys.LLM.EXPERT_COUNT, 0):  # (llama.cpp stores Mixtral as "llama" with stacked experts)
        raise ValueError(f"GGUF file {reader.data.filename} holds a mixture-of-experts model "
                         f"({meta(gguf.Keys.LLM.EXPERT_COUNT)} experts), which nanoinfer loads only from Hugging Face "
                         f"safetensors folders")
    scaling = meta(gguf.Keys.Rope.SCALING_TYPE, "none")
    if scaling != "none":
        raise ValueError(f"GGUF rope scaling {scaling!r} of {reader.data.filename} is not supported")
    hidden_size = meta(gguf.Keys.LLM.EMBEDDING_LENGTH)
    num_heads = meta(gguf.Keys.Attention.HEAD_COUNT)
    if not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"GGUF file {reader.data.filename}: {arch}.attention.head_count must be a positive "
                         f"integer, got {num_heads!r}")
    head_dim = meta(gguf.Keys.Attention.KEY_LENGTH, hidden_size // num_heads)
    rotary_dim = meta(gguf.Keys.Rope.DIMENSION_COUNT, head_dim)
    if rotary_dim != head_dim:
        raise ValueError(f"partial rotary ({rotary_dim} of {head_dim} dims) in {reader.data.filename} is not supported")
    tensor_names = {t.name for t in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ValueError(f"GGUF file {reader.data.filename} has no token_embd.weight tensor")
    eos_ids = [_field(reader, gguf.Keys.Tokenizer.EOS_ID)]
    eot_id = _field(reader, gguf.Keys.Tokenizer.EOT_ID, None)
    if eot_id is not None and eot_id not in eos_ids:
        eos_ids.append(eot_id)
    hf_arch, _ = _ARCHITECTURES[arch]
    return CONFIG_MAPPING[arch](
        architectures=[hf_arch],
        vocab_size=int(embed.shape[1]),  # GGUF shapes are innermost-first: (hidden, vocab)
        hidden_size=hidden_size,
        intermediate_size=meta(gguf.Keys.LLM.FEED_FORWARD_LENGTH),
        num_hidden_layers=meta(gguf.Keys.LLM.BLOCK_COUNT),
        num_attention_heads=num_heads,
        num_key_value_heads=meta(gguf.Keys.Attention.HEAD_COUNT_KV, num_heads),
        head_dim=head_dim,
        max_position_embeddings=meta(gguf.Keys.LLM.CONTEXT_LENGTH),
        rms_norm_eps=meta(gguf.Keys.Attention.LAYERNORM_RMS_EPS),
        rope_theta=meta(gguf.Keys.Rope.FREQ_BASE, 10000.0),
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, gguf.Keys.Tokenizer.BOS_ID, None),
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        pad_token_id=_field(reader, gguf.Keys.Tokenizer.PAD_ID, None),
        dtype="float32",
    )


def _hf_tensor_name(gguf_name: str, path: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_TENSOR_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} in {path} has no Hugging Face counterpart we support")


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert, which reorders each head's Q/K rows from the
    HF rotate-half layout into interleaved (even, odd) pairs."""
    rows = weight.shape[0]
    split = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def _convert_tensors(reader: gguf.GGUFReader, arch: str, config) -> dict[str, np.ndarray]:
    _, permuted = _ARCHITECTURES[arch]
    heads_of = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    tensors = {}
    for tensor in reader.tensors:
        name = _hf_tensor_name(tensor.name, reader.data.filename)
        weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        kind = tensor.name.split(".")[-2]
        if permuted and kind in heads_of:
            weight = _unpermute_rows(weight, heads_of[kind])
        tensors[name] = np.ascontiguousarray(weight)
    return tensors


def _save_tokenizer(gguf_path: str, reader: gguf.GGUFReader, config, out_dir: str) -> None:
    """Use transformers' GGUF tokenizer conversion, pin the GGUF's chat template on it,
    and write the special ids as a generation config so generation stops at EOS."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)),
                                                  gguf_file=os.path.basename(gguf_path))
    except Exception as e:  # transformers' conversion raises what it meets (KeyError, IndexError, ...)
        raise ValueError(f"GGUF file {gguf_path}: its tokenizer cannot be read ({type(e).__name__}: {e})") from None
    chat_template = _field(reader, gguf.Keys.Tokenizer.CHAT_TEMPLATE, None)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out_dir)


def convert_gguf(gguf_path: str, out_dir: str) -> str:
    """Write `out_dir` as an HF folder built from `gguf_path`; returns `out_dir`.

    The folder is assembled in a temporary sibling and renamed into place, so an
    interrupted conversion never leaves a half-written `out_dir` behind.
    """
    reader = _open(gguf_path)
    arch = _architecture(reader)
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir):
        raise FileExistsError(f"conversion target already exists: {out_dir}")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    # The pid in its name: a conversion whose process died (killed mid-way) is found and removed later.
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-{os.getpid()}-", dir=parent)
    try:
        os.chmod(tmp_dir, 0o755)  # a shared cache: readable by all, as the files in it
        config = _build_config(reader, arch)
        config.save_pretrained(tmp_dir)
        weights = os.path.join(tmp_dir, "model.safetensors")
        save_file(_convert_tensors(reader, arch, config), weights, metadata={"format": "pt"})
        os.chmod(weights, 0o644)  # safetensors writes 0600 whatever the umask
        _save_tokenizer(gguf_path, reader, config, tmp_dir)
        files = {name: os.path.getsize(os.path.join(tmp_dir, name)) for name in os.listdir(tmp_dir)}
        with open(os.path.join(tmp_dir, MARKER_FILE), "w") as f:
            json.dump({"source": os.path.abspath(gguf_path), "size": os.path.getsize(gguf_path), "files": files}, f)
        try:
            os.replace(tmp_dir, out_dir)
        except OSError as e:
            if os.path.exists(out_dir):  # another process finished the same conversion first
                raise FileExistsError(f"conversion target already exists: {out_dir}") from e
            raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def cache_dir() -> str:
    """Where converted GGUF files live; NANOINFER_CACHE_DIR overrides it (tests, read-only homes)."""
    return os.environ.get("NANOINFER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanoinfer")


def file_digest(path: str) -> str:
    """xxh3-64 of the file's bytes (~50 ms for the 94 MiB default model)."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def resolve_gguf(gguf_path: str) -> str:
    """Return the cached HF folder for `gguf_path`, converting it on first use.

    The cache key is the file name and a hash of its bytes: a reinstalled copy
    (same bytes, new mtime) reuses the conversion, an edited or replaced file is
    converted again, and the older conversions of the same path are removed then,
    so the cache holds one folder (~540 MB for the default model) per source file.
    """
    _check_file(gguf_path)
    name = os.path.splitext(os.path.basename(gguf_path))[0]
    out_dir = os.path.join(cache_dir(), f"{name}-{file_digest(gguf_path)}")
    if _is_complete(out_dir):
        return out_dir
    if os.path.exists(out_dir):  # not written by convert_gguf, or damaged since: nothing in it can be trusted
        logger.warning("%s is incomplete or damaged: made anew from %s", out_dir, gguf_path)
        shutil.rmtree(out_dir)
    _remove_abandoned_conversions(name)
    logger.info("converting %s once; cached at %s", gguf_path, out_dir)
    try:
        convert_gguf(gguf_path, out_dir)
    except FileExistsError:
        if not os.path.exists(os.path.join(out_dir, MARKER_FILE)):
            raise
    _remove_older_conversions(gguf_path, name, keep=out_dir)
    return out_dir


def _is_complete(folder: str) -> bool:
    """Whether `folder` is a finished conversion with every file it wrote, at the size it wrote it (a cut or
    deleted file would fail every load after it)."""
    try:
        with open(os.path.join(folder, MARKER_FILE)) as f:
            files = json.load(f).get("files", {})
        return all(os.path.getsize(os.path.join(folder, name)) == size for name, size in files.items())
    except (OSError, ValueError, AttributeError):
        return False


def _remove_abandoned_conversions(name: str) -> None:
    """The temporary folders of conversions of `name` whose process is gone (killed mid-way): ~0.5 GB each."""
    for folder in glob.glob(os.path.join(glob.escape(cache_dir()), f".{glob.escape(name)}-*.tmp-*-*")):
        pid = os.path.basename(folder).rsplit(".tmp-", 1)[1].split("-", 1)[0]
        if pid.isdigit() and not _process_exists(int(pid)):
            logger.info("removing %s, left by a conversion that did not finish", folder)
            shutil.rmtree(folder, ignore_errors=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def _remove_older_conversions(gguf_path: str, name: str, keep: str) -> None:
    source = os.path.abspath(gguf_path)
    for folder in glob.glob(os.path.join(glob.escape(cache_dir()), f"{glob.escape(name)}-*")):
        try:
            with open(os.path.join(folder, MARKER_FILE)) as f:
                stale = json.load(f).get("source") == source and os.path.abspath(folder) != os.path.abspath(keep)
        except (OSError, ValueError):
            continue  # not a finished conversion (maybe one in progress): not ours to remove
        if stale:
            logger.info("removing %s, an older conversion of %s", folder, gguf_path)
            shutil.rmtree(folder, ignore_errors=True)
