"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral; layers/moe.py): greedy output equals Hugging Face
transformers' token for token, with chunked prefill and under tensor parallelism; routing equals transformers'
routers; the experts' math equals its per-token definition; dummy weights, LoRA on the attention projections, and
every bad configuration (LoRA on experts, a tensor-parallel size that does not divide the experts, a missing expert
weight, bad MoE config values) is a clear error; fp8 experts (`quantization="fp8"`, or an fp8 checkpoint) equal
transformers on the dequantized weights. The fused kernel is tested against `fused_moe_math` in
tests/test_moe_kernel.py."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import make_tiny_model
from safetensors.torch import load_file, save_file
from test_e2e import hf_greedy

from nanoinfer import LLM, LoRARequest, SamplingParams
from nanoinfer.layers.moe import FusedMoE, fused_moe_math, is_moe_layer, route
from nanoinfer.loader.weights import get_hf_config, load_model

NUM_TOKENS = 10
PROMPTS = [[5, 9, 17, 3, 88, 120, 7], [200, 1, 2, 3], list(range(30, 70))]
# Qwen3-MoE with a dense layer between sparse ones (`mlp_only_layers`) and renormalised top-k weights; Mixtral.
ARCHS = {"qwen3_moe": dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True), "mixtral": {},
         "qwen2_moe": {}}  # (Qwen2-MoE: a gated shared expert beside the routed ones; q/k/v biases)


def greedy(n: int = NUM_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, dict]:
    """Each tiny MoE model's folder and transformers' greedy tokens for PROMPTS."""
    root = tmp_path_factory.mktemp("moe")
    result = {}
    for arch, overrides in ARCHS.items():
        path = make_tiny_model(str(root / arch), arch, **overrides)
        result[arch] = {"path": path, "expected": hf_greedy(path, PROMPTS, NUM_TOKENS)}
    return result


# ----- the parts -----


def make_tiny_model_config(arch: str, **overrides) -> str:
    """A tiny model's config.json alone (for dummy weights), written by transformers."""
    import tempfile

    import transformers

    folder = tempfile.mkdtemp()
    config_cls = {"qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig,
                  "qwen3": transformers.Qwen3Config}[arch]
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, head_dim=16)
    if arch == "qwen3_moe":
        base.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    if arch == "mixtral":
        base.update(num_local_experts=4, num_experts_per_tok=2)
    config = config_cls(**{**base, **overrides})
    config.architectures = [{"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                             "qwen3": "Qwen3ForCausalLM"}[arch]]
    config.save_pretrained(folder)
    return os.path.join(folder, "config.json")


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_equals_the_transformers_router(arch, renormalize):
    import transformers

    if arch == "mixtral" and not renormalize:
        pytest.skip("Mixtral always renormalises")
    torch.manual_seed(0)
    if arch == "mixtral":
        config = transformers.MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)
        router = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(config)
    else:
        config = transformers.Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3,
                                             norm_topk_prob=renormalize)
        router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(config)
    router.weight.data.normal_()
    x = torch.randn(20, 32)
    logits, expected_weights, expected_ids = router(x)
    weights, ids = route(logits, config.num_experts_per_tok, renormalize)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, expected_weights.float(), rtol=0, atol=0)


def test_fused_moe_math_is_the_weighted_sum_of_each_tokens_experts():
    """Written here per token and per chosen expert, in float64."""
    torch.manual_seed(0)
    T, H, I, E, k = 7, 12, 10, 5, 3
    x, w13, w2 = torch.randn(T, H), torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).int()
    ids[:, 0] = 2  # every token shares an expert; expert 4 may get none
    weights = torch.rand(T, k)
    expected = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            g, u = w13[e, :I].double() @ x[t].double(), w13[e, I:].double() @ x[t].double()
            expected[t] += weights[t, j].double() * (w2[e].double() @ (F.silu(g) * u))
    torch.testing.assert_close(fused_moe_math(x, w13, w2, weights, ids).double(), expected, rtol=1e-5, atol=1e-5)
    assert fused_moe_math(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, H)


def test_which_layers_are_sparse():
    qwen = get_hf_config(make_tiny_model_config("qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2,
                                                mlp_only_layers=[3]))
    assert [is_moe_layer(qwen, i) for i in range(6)] == [False, True, False, False, False, True]
    dense = get_hf_config(make_tiny_model_config("qwen3"))
    assert not any(is_moe_layer(dense, i) for i in range(2))


def test_dummy_weights_fill_every_expert():
    """Dummy weights come under the checkpoints' names (one tensor per expert, as transformers saves them)."""
    hf_config = get_hf_config(make_tiny_model_config("qwen3_moe", mlp_only_layers=[1]))
    model = load_model(None, hf_config, "dummy", torch.float32, torch.device("cpu"))
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, FusedMoE)
    assert experts.w13_weight.shape == (8, 64, 64) and experts.w2_weight.shape == (8, 64, 32)
    bound = (3.0 / 64) ** 0.5  # fan-in 64, as a 2-D checkpoint tensor's
    assert 0.9 * bound < experts.w13_weight.abs().max() <= bound
    assert all(experts.w13_weight[e].std() > 0.5 * bound for e in range(8))  # no expert left unfilled
    assert not isinstance(model.model.layers[1].mlp, FusedMoE) and hasattr(model.model.layers[1].mlp, "gate_up_proj")
    llm = LLM(str(make_tiny_model_config("mixtral")), load_format="dummy", device="cpu", num_kv_blocks=32)
    assert len(llm.generate([PROMPTS[0]], greedy(4), use_tqdm=False)[0].outputs[0].token_ids) == 4


# ----- the engine -----


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_output_equals_transformers(moe_models, arch):
    case = moe_models[arch]
    llm = LLM(case["path"], block_size=4, device="cpu")
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == case["expected"]


def test_chunked_prefill_mixed_with_decodes_equals_transformers(moe_models):
    """A budget of 8 tokens: prompts arrive in chunks beside other requests' decode tokens in one forward."""
    case = moe_models["qwen3_moe"]
    llm = LLM(case["path"], block_size=4, device="cpu", max_num_batched_tokens=8, max_num_seqs=3)
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == case["expected"]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_tp2_equals_transformers(moe_models, arch):
    """Two gloo ranks: each holds every expert's half of the intermediate dimension (and of the shared expert's);
    the routers are replicated."""
    case = moe_models[arch]
    llm = LLM(case["path"], block_size=4, device="cpu", tensor_parallel_size=2, num_kv_blocks=64)
    try:
        assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == case["expected"]
    finally:
        llm.close()
    assert not dist.is_initialized()


def test_lora_on_the_attention_projections_of_an_moe_model(moe_models, tmp_path):
    """Adapters on q/v equal the merged model in transformers; an adapter on a sparse layer's MLP is refused."""
    from test_lora import make_adapter, merge

    case = moe_models["qwen3_moe"]
    adapter = make_adapter(tmp_path / "qv", case["path"], seed=1, modules=("q_proj", "v_proj"))
    expected = hf_greedy(merge(case["path"], adapter, tmp_path / "merged"), PROMPTS, NUM_TOKENS)
    assert expected != case["expected"]
    llm = LLM(case["path"], enable_lora=True, max_lora_rank=4, block_size=4, device="cpu")
    outputs = llm.generate(PROMPTS, greedy(), lora_request=LoRARequest("qv", 1, adapter), use_tqdm=False)
    assert token_ids(outputs) == expected
    bad = make_adapter(tmp_path / "mlp", case["path"], seed=2, modules=("gate_proj",))
    with pytest.raises(ValueError, match="layer 0's MLP, which is a mixture of experts here"):
        llm.generate(PROMPTS[:1], greedy(), lora_request=LoRARequest("mlp", 2, bad), use_tqdm=False)
    # (the engine goes on: the refused request harmed nothing)
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == case["expected"]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_stacked_experts_as_transformers_5_saves_them_load_too(moe_models, tmp_path, arch):
    """transformers 5 keeps each layer's experts stacked ([E, 2I, H] gate then up rows, [E, H, I]) and saves them so
    without its legacy names (`save_original_format=False`; Mixtral's block then named `mlp`): our own layout,
    loaded at TP=1 and sliced at TP=2."""
    from transformers import AutoModelForCausalLM

    case = moe_models[arch]
    folder = tmp_path / "stacked"
    AutoModelForCausalLM.from_pretrained(case["path"]).save_pretrained(folder, save_original_format=False)
    names = load_file(str(folder / "model.safetensors")).keys()
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any(".experts.0." in n for n in names)
    with LLM(str(folder), block_size=4, device="cpu") as llm:
        assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == case["expected"]
    llm = LLM(str(folder), block_size=4, device="cpu", tensor_parallel_size=2, num_kv_blocks=64)
    try:
        assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == case["expected"]
    finally:
        llm.close()
    if arch != "qwen3_moe":
        return
    # both layouts of one layer's experts: which to load is unknown
    tensors = load_file(str(folder / "model.safetensors"))
    stacked = tensors["model.layers.0.mlp.experts.gate_up_proj"]
    tensors["model.layers.0.mlp.experts.3.gate_proj.weight"] = stacked[3, :32].clone()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"holds model.layers.0.mlp.experts.w13_weight twice, in two layouts"):
        LLM(str(folder), device="cpu")


# ----- fp8 experts -----


def dequantized_moe_reference(base: str, folder) -> str:
    """`base` as an fp8 engine computes it, saved for transformers (written here from the definition): the
    attention projections as tests/test_fp8.py's `dequantized_reference` makes them (q/k/v folded with the input
    norm), every expert's gate, up and down rows quantize_rows(W) (an MoE block's norm is not folded), a dense
    layer's MLP as in a dense model; the router stays as it is."""
    from test_fp8 import quantize_rows
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            g = layer.input_layernorm.weight
            for proj in (attention.q_proj, attention.k_proj, attention.v_proj):
                proj.weight.copy_(quantize_rows(proj.weight * g) / g)
            attention.o_proj.weight.copy_(quantize_rows(attention.o_proj.weight))
            if hasattr(mlp, "experts"):  # transformers 5 keeps them stacked: [E, 2I, H] and [E, H, I]
                for w in (mlp.experts.gate_up_proj, mlp.experts.down_proj):
                    w.copy_(quantize_rows(w.flatten(0, 1)).view(w.shape))
            # A dense MLP, or Qwen2-MoE's shared expert: it reads the residual stream, the norm folded into it.
            dense = getattr(mlp, "shared_expert", None) if hasattr(mlp, "experts") else mlp
            if dense is not None:
                g = layer.post_attention_layernorm.weight
                for proj in (dense.gate_proj, dense.up_proj):
                    proj.weight.copy_(quantize_rows(proj.weight * g) / g)
                dense.down_proj.weight.copy_(quantize_rows(dense.down_proj.weight))
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def fp8_moe(moe_models, tmp_path_factory) -> dict:
    """The Qwen3-MoE model with every weight perturbed (no norm all ones), and its dequantized reference's greedy
    tokens."""
    from test_lora import perturbed

    root = tmp_path_factory.mktemp("fp8moe")
    base = perturbed(moe_models["qwen3_moe"]["path"], root / "base")
    return {"base": base, "expected": hf_greedy(dequantized_moe_reference(base, root / "deq"), PROMPTS, NUM_TOKENS)}


def test_fp8_experts_equal_transformers_on_the_dequantized_weights(fp8_moe, moe_models, tmp_path):
    llm = LLM(fp8_moe["base"], quantization="fp8", block_size=4, device="cpu")
    experts = [m for m in llm.llm_engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 2 and all(m.w13_weight.dtype == m.w2_weight.dtype == torch.float8_e4m3fn
                                     and m.w13_scale.shape == (8, 64) and m.w2_scale.shape == (8, 64) for m in experts)
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == fp8_moe["expected"]
    # Qwen2-MoE: its shared expert is quantized as a dense MLP (the norm folded into it)
    from test_lora import perturbed

    base = perturbed(moe_models["qwen2_moe"]["path"], tmp_path / "qwen2")
    expected = hf_greedy(dequantized_moe_reference(base, tmp_path / "qwen2-deq"), PROMPTS, NUM_TOKENS)
    with LLM(base, quantization="fp8", block_size=4, device="cpu") as qwen2:
        shared = qwen2.llm_engine.core.runner.model.model.layers[0].mlp.shared_expert
        assert shared.gate_up_proj.weight.dtype == torch.float8_e4m3fn
        assert token_ids(qwen2.generate(PROMPTS, greedy(), use_tqdm=False)) == expected


def test_tp2_fp8_experts_equal_tp1(fp8_moe):
    """A down row is split over the ranks; its scale is still the whole row's (an all-reduce max at load)."""
    llm = LLM(fp8_moe["base"], quantization="fp8", block_size=4, device="cpu", tensor_parallel_size=2,
              num_kv_blocks=64)
    try:
        assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == fp8_moe["expected"]
    finally:
        llm.close()


def test_an_fp8_moe_checkpoint_loads_as_its_dequantized_weights(fp8_moe, tmp_path):
    """Per-expert fp8 tensors with 16 x 32 block scales (as Qwen3-30B-A3B-FP8 ships them, at its own 128 x 128):
    dequantized as read, then quantized per row, as an fp8 engine on the dequantized folder does."""
    from test_fp8 import write_fp8_checkpoint

    quantized, dequantized = write_fp8_checkpoint(fp8_moe["base"], tmp_path / "ckpt", "block")
    assert "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv" in load_file(f"{quantized}/model.safetensors")
    with LLM(quantized, block_size=4, device="cpu") as ours:
        ours_experts = [m for m in ours.llm_engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
        with LLM(dequantized, quantization="fp8", block_size=4, device="cpu") as reference:
            theirs = [m for m in reference.llm_engine.core.runner.model.modules() if isinstance(m, FusedMoE)]
            for a, b in zip(ours_experts, theirs):
                assert a.w13_weight.dtype == torch.float8_e4m3fn
                assert torch.equal(a.w13_weight.float(), b.w13_weight.float()) and torch.equal(a.w2_scale, b.w2_scale)
            expected = token_ids(reference.generate(PROMPTS, greedy(), use_tqdm=False))
        assert token_ids(ours.generate(PROMPTS, greedy(), use_tqdm=False)) == expected


# ----- bad input -----


def test_a_tensor_parallel_size_that_does_not_divide_the_experts_is_refused(tmp_path):
    path = make_tiny_model(str(tmp_path / "m"), "qwen3_moe", moe_intermediate_size=33)
    with pytest.raises(ValueError, match="the experts' intermediate size=33 is not divisible by the tensor-parallel "
                                         "size 2"):
        LLM(path, device="cpu", tensor_parallel_size=2, num_kv_blocks=32)


def test_a_missing_expert_weight_is_named(moe_models, tmp_path):
    source = moe_models["qwen3_moe"]["path"]
    tensors = load_file(os.path.join(source, "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    (tmp_path / "m").mkdir()
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    (tmp_path / "m" / "config.json").write_text(open(os.path.join(source, "config.json")).read())
    with pytest.raises(ValueError, match=r"missing weights \['model.layers.2.mlp.experts.5.up_proj.weight'\]"):
        LLM(str(tmp_path / "m"), device="cpu")


@pytest.mark.parametrize("field,value,message", [
    ("moe_intermediate_size", 0, "moe_intermediate_size must be a positive integer, got 0"),
    ("num_experts", -1, "num_experts must be a non-negative integer, got -1"),
    ("decoder_sparse_step", 0, "decoder_sparse_step must be a positive integer, got 0"),
    ("num_experts_per_tok", 0, "num_experts_per_tok must be a positive integer, got 0"),
    ("shared_expert_intermediate_size", -8, "shared_expert_intermediate_size must be a positive integer, got -8"),
])
def test_bad_moe_config_values_are_named(tmp_path, field, value, message):
    config = json.loads(open(make_tiny_model_config("qwen3_moe")).read())
    config.pop("num_local_experts", None)  # (transformers 5 saves Qwen3-MoE's num_experts under this name)
    config.setdefault("num_experts", 8)
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path / "config.json"), load_format="dummy", device="cpu")


def test_more_experts_per_token_than_experts_is_refused():
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be between 1 and the number of experts"):
        LLM(make_tiny_model_config("qwen3_moe", num_experts_per_tok=9), load_format="dummy", device="cpu")


def test_stacked_fp8_experts_are_refused_by_name(moe_models, tmp_path):
    """transformers 5's stacked layout with fp8 experts (`experts.gate_up_proj` float8 beside
    `gate_up_proj_scale_inv`): refused, saying how to save a checkpoint that loads."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "stacked"
    AutoModelForCausalLM.from_pretrained(moe_models["qwen3_moe"]["path"]).save_pretrained(
        folder, save_original_format=False)
    tensors = load_file(str(folder / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[f"{name}_scale_inv"] = torch.ones(tensors[name].shape[0], 1, 1)
        tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [16, 32]}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MoE experts stacked in fp8 .* save the checkpoint with one tensor per "):
        LLM(str(folder), device="cpu")
