"""Bad input gets a clear error before it enters the engine, and never harms
requests already in flight."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

from nanoinfer import LLM, EngineConfig, SamplingParams

SMALL_KV = 32 << 20


@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    return LLM(tiny_models["llama"], kv_cache_memory_bytes=SMALL_KV, max_model_len=128)


def test_unknown_engine_argument() -> None:
    with pytest.raises(TypeError, match="unknown engine argument.*'max_num_sequences'"):
        LLM(max_num_sequences=4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=0), "block_size must be a positive integer"),
    (dict(dtype="float8"), "dtype='float8' is not one of"),
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype='int8' is not one of"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(scheduling_policy="random"), "scheduling_policy"),
    (dict(reasoning_parser="nope"), "reasoning_parser='nope' is not one of"),
])
def test_bad_engine_config(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_missing_model_path(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_corrupt_gguf(tmp_path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="broken.gguf"):
        LLM(str(bad))


def test_unsupported_architecture(tmp_path, tiny_models) -> None:
    config = json.loads(open(f"{tiny_models['llama']}/config.json").read())
    config["architectures"] = ["FalconForCausalLM"]
    config["model_type"] = "falcon"
    del config["head_dim"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FalconForCausalLM"):
        LLM(str(tmp_path / "config.json"), load_format="dummy")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the model config"):
        LLM(str(tmp_path / "config.json"), load_format="dummy")


def test_a_sliding_window_no_shorter_than_the_context_is_full_attention(tmp_path, tiny_models) -> None:
    """Mistral-7B-v0.1 (window 4096) and Qwen models with use_sliding_window load with max_model_len up to the
    window, where attention is full; a longer context is refused (sliding windows are not implemented)."""
    import json

    folder = copy_model(tiny_models["qwen3"], tmp_path / "windowed")
    config = json.load(open(f"{folder}/config.json"))
    json.dump(config | {"use_sliding_window": True, "sliding_window": 64}, open(f"{folder}/config.json", "w"))
    with pytest.raises(ValueError, match="sliding_window=64.*give max_model_len <= 64"):
        LLM(folder, num_kv_blocks=16)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    windowed = LLM(folder, max_model_len=64, num_kv_blocks=16).generate([[1, 2, 3]], greedy, use_tqdm=False)
    plain = LLM(tiny_models["qwen3"], max_model_len=64, num_kv_blocks=16).generate([[1, 2, 3]], greedy, use_tqdm=False)
    assert windowed[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_max_model_len_beyond_model(tiny_models) -> None:
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(tiny_models["llama"], max_model_len=100_000)


@pytest.mark.parametrize("prompt, params, error, match", [
    ([], SamplingParams(), ValueError, "prompt is empty"),
    ("", SamplingParams(), ValueError, "prompt is empty"),
    ([1, 2, 9999], SamplingParams(), ValueError, "outside the vocabulary"),
    ([-1, 2], SamplingParams(), ValueError, "token id -1 is outside the vocabulary"),
    ([1.5, 2], SamplingParams(), TypeError, "token ids must be Python ints, got float 1.5"),
    ([1, True], SamplingParams(), TypeError, "token ids must be Python ints, got bool True"),
    ([1] * 120, SamplingParams(max_tokens=20), ValueError, r"exceeds max_model_len \(128\)"),
    ([1] * 128, SamplingParams(max_tokens=None), ValueError, "at most 127"),
    ("hello", SamplingParams(), ValueError, "no tokenizer"),
    ([1, 2], SamplingParams(stop=["x"]), ValueError, "stop strings need a tokenizer"),  # not silently ignored
    ([1, 2], SamplingParams(logit_bias={9999: 1.0}), ValueError, "logit_bias entry 9999 is outside the vocabulary"),
])
def test_bad_requests_rejected(llm: LLM, prompt, params, error, match) -> None:
    with pytest.raises(error, match=match):
        llm.generate([prompt], params, use_tqdm=False)


def test_text_and_whole_searches_are_checked_before_anything_runs(llm: LLM) -> None:
    """A stream yields text, which a model without a tokenizer has none of; a beam search whose longest beams
    would pass max_model_len is refused in the caller's terms before its first step."""
    from nanoinfer import BeamSearchParams

    with pytest.raises(ValueError, match="stream\\(\\) yields text, which needs a tokenizer"):
        llm.stream([1, 2], SamplingParams())
    with pytest.raises(ValueError, match=r"prompt \(120 tokens\) \+ max_tokens \(10\) = 130 exceeds max_model_len"):
        llm.beam_search([[1] * 120], BeamSearchParams(beam_width=2, max_tokens=10))
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_call_max_num_waiting_could_never_queue_is_refused_whole(tiny_models) -> None:
    """generate() adds all its requests before running them: more than max_num_waiting (n counted) is a clear
    error, not the full queue's retry-later OverflowError that waiting could never cure."""
    llm = LLM(tiny_models["llama"], num_kv_blocks=16, max_num_waiting=2)
    with pytest.raises(ValueError, match=r"needs 3 places in the waiting queue"):
        llm.generate([[1, 2], [3, 4], [5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"needs 4 places in the waiting queue"):
        llm.generate([[1, 2], [3, 4]], SamplingParams(n=2, max_tokens=2), use_tqdm=False)
    assert len(llm.generate([[1, 2], [3, 4]], SamplingParams(max_tokens=2), use_tqdm=False)) == 2
    assert llm.llm_engine.core.scheduler.kv_cache_manager.num_free_blocks == llm.llm_engine.core.num_blocks


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n"),
])
def test_bad_sampling_params(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_request_does_not_disturb_others(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("good", [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    with pytest.raises(ValueError):
        engine.add_request("bad", [1] * 200, SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", [1, 2], SamplingParams())
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final.request_id == "good" and len(final.outputs[0].token_ids) == 8
    alone = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert alone[0].outputs[0].token_ids == final.outputs[0].token_ids
    assert engine.core.scheduler.kv_cache_manager.num_free_blocks == engine.core.num_blocks


def test_abort_frees_blocks(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("a", list(range(1, 60)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.core.scheduler.kv_cache_manager.num_free_blocks < engine.core.num_blocks
    (out,) = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    engine.step()
    assert not engine.has_unfinished_requests()
    assert engine.core.scheduler.kv_cache_manager.num_free_blocks == engine.core.num_blocks


def test_generate_all_or_nothing(llm: LLM) -> None:
    """A bad prompt in a batch rejects the batch and leaves nothing behind in the engine."""
    with pytest.raises(ValueError):
        llm.generate([[1, 2], []], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.core.scheduler.kv_cache_manager.num_free_blocks == llm.llm_engine.core.num_blocks


# ----- model files and settings (a review of 2026-11-24: each of these failed deep inside, or silently) -----


def copy_model(src: str, dst) -> str:
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def test_unreadable_or_ambiguous_checkpoints_name_the_file(tmp_path, tiny_models) -> None:
    from safetensors.torch import load_file, save_file

    folder = copy_model(tiny_models["llama"], tmp_path / "m")
    weights = f"{folder}/model.safetensors"
    data = open(weights, "rb").read()
    open(weights, "wb").write(data[: len(data) // 2])  # cut short
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(folder)
    open(weights, "wb").write(data)
    tensors = load_file(weights)
    name = "model.norm.weight"
    save_file({name: torch.zeros_like(tensors[name])}, f"{folder}/extra.safetensors")
    save_file({k: v for k, v in tensors.items()}, f"{folder}/model-00001.safetensors")
    os.remove(weights)  # the two files are now globbed; both hold model.norm.weight
    with pytest.raises(ValueError, match="'model.norm.weight' is in two checkpoint files"):
        LLM(folder)
    os.remove(f"{folder}/extra.safetensors")
    save_file({**tensors, name: tensors[name].to(torch.int32)}, f"{folder}/model-00001.safetensors")
    with pytest.raises(ValueError, match="'model.norm.weight' is torch.int32: weights must be floating point"):
        LLM(folder)
    save_file({**tensors, "norm.weight": torch.zeros_like(tensors[name])}, f"{folder}/model-00001.safetensors")
    with pytest.raises(ValueError, match="'model.norm.weight' is in the checkpoint twice: as 'norm.weight'"):
        LLM(folder)  # (a bare name is read under "model.": one would silently overwrite the other)
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    save_file({**tensors, o_proj: tensors[o_proj].flatten()}, f"{folder}/model-00001.safetensors")
    with pytest.raises(ValueError, match=f"cannot load checkpoint tensor '{o_proj}' of shape"):
        LLM(folder)  # (a row-parallel weight of one dimension: its shard's dimension was an IndexError)
    save_file(tensors, f"{folder}/model-00001.safetensors")
    for index in ("{not json", "[]", '{"weight_map": {"a": 3}}', "{}"):
        open(f"{folder}/model.safetensors.index.json", "w").write(index)
        with pytest.raises(ValueError, match="is not a valid shard index"):
            LLM(folder)


@pytest.mark.parametrize("changes, match", [
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3 must divide num_attention_heads=4"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be a positive number"),
])
def test_model_config_sizes_are_checked_first(tmp_path, tiny_models, changes, match) -> None:
    config = json.loads(open(f"{tiny_models['llama']}/config.json").read())
    assert config["num_attention_heads"] == 4
    (tmp_path / "config.json").write_text(json.dumps(config | changes))
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path / "config.json"), load_format="dummy")


def test_generation_config_errors_name_the_file(tmp_path, tiny_models) -> None:
    folder = copy_model(tiny_models["llama"], tmp_path / "m")
    open(f"{folder}/generation_config.json", "w").write("{bad")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        LLM(folder)
    open(f"{folder}/generation_config.json", "w").write('{"eos_token_id": ["a"]}')
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be a token id"):
        LLM(folder)


def test_settings_checked_at_construction(tmp_path, tiny_models) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer path '/nonexistent/tok' does not exist"):
        LLM(tiny_models["llama"], tokenizer="/nonexistent/tok")
    with pytest.raises(ValueError, match="smaller than one KV block"):
        LLM(tiny_models["llama"], kv_cache_memory_bytes=1)
    with pytest.raises(ValueError, match="attention_backend='triton' needs a CUDA GPU"):
        LLM(tiny_models["llama"], device="cpu", attention_backend="triton")
    assert LLM(pathlib.Path(tiny_models["llama"]), num_kv_blocks=8).llm_engine.config.model == tiny_models["llama"]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(model=0), TypeError, "model must be a path"),
    (dict(enforce_eager="false"), TypeError, "enforce_eager must be True or False"),
    (dict(gpu_memory_utilization="0.5"), ValueError, "gpu_memory_utilization must be a number"),
    (dict(gpu_memory_utilization=True), ValueError, "gpu_memory_utilization must be a number"),
    (dict(seed=2**64), ValueError, "seed must be an integer"),
    (dict(block_size=1 << 20), ValueError, "block_size must be at most 1024"),
])
def test_engine_argument_types(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        EngineConfig(**kwargs)


def test_dtype_takes_vllms_aliases_and_torch_dtypes() -> None:
    for given, meant in (("half", "float16"), ("float", "float32"), (torch.bfloat16, "bfloat16"),
                         (torch.float16, "float16"), ("bfloat16", "bfloat16")):
        assert EngineConfig(dtype=given).dtype == meant
    with pytest.raises(ValueError, match="dtype='int8' is not one of"):
        EngineConfig(dtype=torch.int8)
