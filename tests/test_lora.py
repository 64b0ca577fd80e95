"""LoRA adapters: greedy output with an adapter equals Hugging Face transformers' on the model with the adapter
merged into its weights (W + scaling * B A, computed here from the adapter files, independently of nanoinfer),
token for token; requests of different adapters and of the base model share steps; an adapter's prefix-cache
blocks are its own; bad adapters are refused at admission with the reason."""

from __future__ import annotations

import json
import math
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import save_file

from nanoinfer import LLM, LoRARequest, SamplingParams
from test_e2e import hf_greedy

NUM_TOKENS = 10
PROMPTS = [[5, 9, 17, 3, 88, 120, 7], [200, 1, 2, 3], list(range(30, 70))]
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def greedy(n: int = NUM_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def module_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection, from the HF config (written here, not taken from nanoinfer)."""
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim), "v_proj": (hidden, kv * head_dim),
            "o_proj": (heads * head_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def make_adapter(folder, base: str, seed: int, rank: int = 4, alpha: float = 8, modules=MODULES,
                 **config_fields) -> str:
    """A random PEFT adapter for the model in `base`, a model folder or its config.json (B not zero, unlike a
    fresh PEFT init)."""
    with open(base if base.endswith(".json") else os.path.join(base, "config.json")) as f:
        config = json.load(f)
    shapes = module_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in modules:
            parent = "self_attn" if module in MODULES[:4] else "mlp"
            name = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            in_features, out_features = shapes[module]
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.3
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.3
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules),
                   "bias": "none", "task_type": "CAUSAL_LM", **config_fields}, f)
    return str(folder)


def merge(base: str, adapter: str, folder) -> str:
    """The base model with the adapter merged into its weights, saved as a model folder."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    with open(os.path.join(adapter, "adapter_config.json")) as f:
        config = json.load(f)
    rank = config["r"]
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    tensors = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    weights = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." in name:
                target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
                weights[target] += scaling * tensors[name.replace("lora_A", "lora_B")] @ a
    model.save_pretrained(folder)
    return str(folder)


def perturbed(base: str, folder) -> str:
    """The model with every weight moved a little, so its norms are not all ones (an adapter's A must be folded
    with the norm weight that nanoinfer folds into the projection: with ones, a missing fold would not show)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory) -> dict:
    """For llama and qwen3: two adapters (one on every projection, rank 4; one on q/v only, rank 8, rsLoRA), and
    for each the merged model's greedy outputs."""
    root = tmp_path_factory.mktemp("lora")
    result = {}
    for arch in ("llama", "qwen3"):
        base = perturbed(tiny_models[arch], root / arch)
        a = make_adapter(root / f"{arch}-a", base, seed=1)
        b = make_adapter(root / f"{arch}-b", base, seed=2, rank=8, alpha=4, modules=("q_proj", "v_proj"),
                         use_rslora=True)
        result[arch] = {"base": base, "a": a, "b": b, "expected": {
            name: hf_greedy(merge(base, path, root / f"{arch}-{name}-merged"), PROMPTS, NUM_TOKENS)
            for name, path in (("a", a), ("b", b))} | {"base": hf_greedy(base, PROMPTS, NUM_TOKENS)}}
    return result


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_adapter_output_equals_the_merged_model_in_transformers(adapters, arch):
    case = adapters[arch]
    assert case["expected"]["a"] != case["expected"]["base"] != case["expected"]["b"]  # the adapters matter
    llm = LLM(case["base"], enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4)
    a, b = LoRARequest("a", 1, case["a"]), LoRARequest("b", 2, case["b"])
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=a)) == case["expected"]["a"]
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=b)) == case["expected"]["b"]
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == case["expected"]["base"]


@pytest.mark.parametrize("max_loras", [1, 2])
def test_adapters_and_the_base_model_in_one_call(adapters, max_loras):
    """Every prompt under adapter a, adapter b and none, in one generate call: each output is its own model's.
    With one slot the adapters take turns (a slot is reloaded), with two they share steps."""
    case = adapters["llama"]
    llm = LLM(case["base"], enable_lora=True, max_loras=max_loras, max_lora_rank=8, block_size=4)
    loras = {"a": LoRARequest("a", 1, case["a"]), "b": LoRARequest("b", 2, case["b"]), "base": None}
    names = [name for name in ("b", "base", "a") for _ in PROMPTS]
    outputs = llm.generate(PROMPTS * 3, greedy(), use_tqdm=False, lora_request=[loras[n] for n in names])
    assert token_ids(outputs) == [ids for name in ("b", "base", "a") for ids in case["expected"][name]]


def test_prefix_cache_blocks_are_per_adapter(adapters):
    case = adapters["llama"]
    llm = LLM(case["base"], enable_lora=True, max_lora_rank=8, block_size=4)
    a = LoRARequest("a", 1, case["a"])
    prompt = PROMPTS[2]
    base = llm.generate([prompt], greedy(), use_tqdm=False)[0]
    first = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=a)[0]
    again = llm.generate([prompt], greedy(), use_tqdm=False, lora_request=a)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0  # the base's blocks are not the adapter's
    assert token_ids([first]) == token_ids([again]) == [case["expected"]["a"][2]]
    assert token_ids([base]) == [case["expected"]["base"][2]]


def test_chat_stream_and_n_take_the_adapter(adapters, smollm2_path):
    case = adapters["llama"]
    llm = LLM(case["base"], enable_lora=True, max_lora_rank=8, tokenizer=smollm2_path)
    a = LoRARequest("a", 1, case["a"])
    text = "".join(llm.stream([5, 9, 17, 3, 88, 120, 7], greedy(), lora_request=a))
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, n=2),
                       use_tqdm=False, lora_request=a)[0]
    assert [list(c.token_ids) for c in out.outputs] == [case["expected"]["a"][0]] * 2
    assert text == llm.get_tokenizer().decode(case["expected"]["a"][0], skip_special_tokens=True)


def test_bad_adapters_are_refused_at_admission(adapters, tmp_path):
    case = adapters["llama"]
    base = case["base"]
    plain = LLM(base, block_size=4)
    with pytest.raises(ValueError, match="serves no adapters.*enable_lora=True"):
        plain.generate([PROMPTS[0]], greedy(), use_tqdm=False, lora_request=LoRARequest("a", 1, case["a"]))
    llm = LLM(base, enable_lora=True, max_lora_rank=4, block_size=4)
    cases = {
        "rank 8, more than max_lora_rank=4": LoRARequest("b", 2, case["b"]),
        "is not a folder": LoRARequest("x", 3, str(tmp_path / "missing")),
        "adapts a module nanoinfer does not": _edited(tmp_path / "embed", base, extra_tensor=(
            "base_model.model.model.embed_tokens.lora_A.weight", (4, 256))),
        "uses use_dora": _edited(tmp_path / "dora", base, use_dora=True),
        "uses modules_to_save": _edited(tmp_path / "save", base, modules_to_save=["lm_head"]),
        "layer 0's q_proj has lora_B missing": _edited(tmp_path / "half", base, drop="layers.0.self_attn.q_proj.lora_B"),
        "has shape .* expected": _edited(tmp_path / "shape", base, extra_tensor=(
            "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight", (4, 64))),
        "adapter_model.bin is a pickle": _edited(tmp_path / "bin", base, to_bin=True),
        "no adapter_config.json": _edited(tmp_path / "noconfig", base, no_config=True),
        "has weights that are not finite": _edited(
            tmp_path / "nan", base, retype=lambda t: t.index_fill(1, torch.tensor([0]), float("nan"))),
        "lora_alpha must be a finite number": _edited(tmp_path / "alpha", base, config_text='{"r": 4, "lora_alpha": '
                                                      + "9" * 400 + "}"),
        "adapter_config.json could not be read: RecursionError": _edited(tmp_path / "deep", base,
                                                                          config_text="[" * 100_000),
        "holds torch.int64, not floating-point weights": _edited(tmp_path / "int", base, retype=lambda t: t.long()),
    }
    fifo = _edited(tmp_path / "fifo", base, no_config=True)
    os.mkfifo(os.path.join(fifo, "adapter_config.json"))  # reading it would block for ever
    cases["no adapter_config.json file"] = fifo
    for i, (why, request) in enumerate(cases.items()):
        if isinstance(request, str):
            request = LoRARequest(f"bad{i}", 10 + i, request)
        with pytest.raises(ValueError, match=why):
            llm.generate([PROMPTS[0]], greedy(), use_tqdm=False, lora_request=request)
    llm.generate([PROMPTS[0]], greedy(), use_tqdm=False, lora_request=LoRARequest("a", 1, case["a"]))
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'a'"):
        llm.generate([PROMPTS[0]], greedy(), use_tqdm=False, lora_request=LoRARequest("other", 1, case["b"]))
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a", 0, case["a"])
    with pytest.raises(ValueError, match="got 1 prompts but 1 params, 1 priorities and 2 LoRA requests"):
        llm.generate([PROMPTS[0]], greedy(), use_tqdm=False, lora_request=[None, None])
    assert llm.llm_engine.core.scheduler.num_unfinished == 0


def _edited(folder, base: str, extra_tensor=None, drop: str | None = None, to_bin: bool = False,
            no_config: bool = False, config_text: str | None = None, retype=None, **config_fields) -> str:
    """A good adapter, then one thing made wrong (`retype`: every tensor through this function)."""
    from safetensors.torch import load_file

    make_adapter(folder, base, seed=3, **config_fields)
    weights = os.path.join(folder, "adapter_model.safetensors")
    tensors = load_file(weights)
    if retype is not None:
        tensors = {name: retype(t) for name, t in tensors.items()}
    if config_text is not None:
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            f.write(config_text)
    if extra_tensor is not None:
        tensors[extra_tensor[0]] = torch.zeros(extra_tensor[1])
    if drop is not None:
        tensors = {k: v for k, v in tensors.items() if drop not in k}
    save_file(tensors, weights)
    if to_bin:
        shutil.move(weights, os.path.join(folder, "adapter_model.bin"))
    if no_config:
        os.remove(os.path.join(folder, "adapter_config.json"))
    return str(folder)


def test_weights_must_stay_finite_in_float16_where_the_model_runs_in_it(adapters, tmp_path):
    """3e5 is finite in float32 and bfloat16, not in float16 (its largest value is 65,504)."""
    from nanoinfer.lora.adapter import LoRAAdapter, LoRARegistry
    from nanoinfer.loader.weights import get_hf_config

    base = adapters["llama"]["base"]
    big = _edited(tmp_path / "big", base, retype=lambda t: t * 1e6)
    config = get_hf_config(base)
    assert LoRAAdapter.load(big, config, 8).rank == 4
    with pytest.raises(ValueError, match="not finite .*in torch.float16"):
        LoRARegistry(config, 8, torch.float16).check(LoRARequest("big", 1, big))


def test_a_failed_request_leaves_no_block_it_computed_in_the_prefix_cache(adapters, tmp_path):
    """Its adapter's folder gone when its step ran: it ran without the adapter and failed. Its blocks, under the
    adapter's key, would give a later request of that adapter (the folder back) base-model KV: they leave the cache."""
    case = adapters["llama"]
    folder = str(shutil.copytree(case["a"], tmp_path / "a"))
    lora = LoRARequest("a", 1, folder)
    llm = LLM(case["base"], enable_lora=True, max_lora_rank=8, block_size=4)
    engine = llm.llm_engine
    engine.add_request("lost", PROMPTS[2], greedy(), lora_request=lora)
    os.rename(folder, folder + ".moved")
    finals = [o for _ in range(100) if engine.has_unfinished_requests() for o in engine.step() if o.finished]
    assert finals[0].outputs[0].finish_reason == "error"
    os.rename(folder + ".moved", folder)
    again = llm.generate([PROMPTS[2]], greedy(), use_tqdm=False, lora_request=lora)[0]
    assert again.num_cached_tokens == 0 and token_ids([again]) == [case["expected"]["a"][2]]


def test_an_adapter_gone_after_admission_fails_its_requests_alone(adapters, tmp_path):
    """Its folder removed between admission and the step that loads it: its requests end with finish_reason
    "error"; the others in the same steps are untouched."""
    case = adapters["llama"]
    gone = shutil.copytree(case["a"], tmp_path / "gone")
    llm = LLM(case["base"], enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4)
    engine = llm.llm_engine
    engine.add_request("lost", PROMPTS[0], greedy(), lora_request=LoRARequest("gone", 1, str(gone)))
    engine.add_request("fine", PROMPTS[0], greedy(), lora_request=LoRARequest("b", 2, case["b"]))
    engine.add_request("base", PROMPTS[1], greedy())
    shutil.rmtree(gone)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["lost"].outputs[0].finish_reason == "error"
    assert list(finals["fine"].outputs[0].token_ids) == case["expected"]["b"][0]
    assert list(finals["base"].outputs[0].token_ids) == case["expected"]["base"][1]
    assert engine.core.scheduler.kv_cache_manager.pool.num_free_blocks == engine.core.num_blocks
