"""FP8 weights (`quantization="fp8"`, layers/fp8.py): greedy output equals Hugging Face transformers' on the
dequantized weights (computed here from the checkpoint, independently of nanoinfer) token for token; fp8
checkpoints (block, per-row and per-tensor scales) load as their dequantized weights; tensor parallelism and LoRA
adapters give what one rank and the merged model give; bad checkpoints are clear errors. The skinny kernel's fp8
weights and the per-token quantization kernel run in Triton's interpreter on CPU (a child pytest)."""

from __future__ import annotations

import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from triton_child import interpreter_child, kernel_test

from nanoinfer import LLM, LoRARequest, SamplingParams
from nanoinfer.layers import fp8
from nanoinfer.layers import skinny_dispatch as dispatch
from nanoinfer.layers.linear import LinearBase

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_TOKENS = 10
PROMPTS = [[5, 9, 17, 3, 88, 120, 7], [200, 1, 2, 3], list(range(30, 70))]
# Each projection and the norm folded into it (None: a row-parallel projection, no norm before it).
NORM_OF = {"q_proj": "input_layernorm", "k_proj": "input_layernorm", "v_proj": "input_layernorm", "o_proj": None,
           "gate_proj": "post_attention_layernorm", "up_proj": "post_attention_layernorm", "down_proj": None}

test_cpu_interpreter_child = interpreter_child(__file__)


def greedy(n: int = NUM_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def quantize_rows(w: torch.Tensor) -> torch.Tensor:
    """The fp8 weight as nanoinfer should mean it, written here from the definition: each row scaled so its
    largest magnitude is 448, rounded to float8_e4m3fn, scaled back (float32)."""
    scale = (w.abs().amax(dim=1) / 448.0).clamp_min(1e-12)
    return (w / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale[:, None]


def dequantized_reference(base: str, folder) -> str:
    """`base` as nanoinfer's fp8 engine computes it, saved for transformers: each projection W after the norm g
    it is folded with becomes quantize_rows(W * g) / g (the engine multiplies the unnormalised stream by the
    quantized W * g and applies the norm's row scale after); row-parallel ones quantize_rows(W)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            for name, norm in NORM_OF.items():
                proj = getattr(layer.self_attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp, name)
                g = torch.ones(proj.weight.shape[1]) if norm is None else getattr(layer, norm).weight
                proj.weight.copy_(quantize_rows(proj.weight * g) / g)
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory) -> dict:
    """For llama and qwen3 (weights perturbed so no norm is all ones): the model and its dequantized reference."""
    from test_lora import perturbed

    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for arch in ("llama", "qwen3"):
        base = perturbed(tiny_models[arch], root / arch)
        out[arch] = {"base": base, "reference": dequantized_reference(base, root / f"{arch}-deq")}
    return out


def engine_model(llm: LLM) -> torch.nn.Module:
    return llm.llm_engine.core.runner.model


# ----- kernels (interpreter child on CPU) -----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split_k", [0, 1, 4])  # 0: the heuristic's config
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("M", [1, 5, 16])
@kernel_test
def test_skinny_kernel_multiplies_fp8_weights_by_their_row_scales(dtype, split_k, residual, M):
    from nanoinfer.kernels import arrival_counters
    from nanoinfer.kernels import skinny_gemm as sg

    N, K = 72, 200
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=gen).to(DEVICE, dtype)
    q, scale = fp8.quantize_per_row(torch.randn(N, K, generator=gen) * torch.rand(N, 1, generator=gen) * 3)
    q, scale = q.to(DEVICE), scale.to(DEVICE)
    bias = torch.randn(N, generator=gen).to(DEVICE, dtype)
    res = torch.randn(M, N, generator=gen).to(DEVICE, dtype) if residual else None
    expected = x.double() @ (q.double() * scale.double()[:, None]).T + bias.double()
    if residual:
        expected += res.double()
    config = None if not split_k else sg.SkinnyConfig(block_n=16, block_k=32, split_k=split_k, num_warps=4,
                                                      num_stages=2)
    out = sg.skinny_linear(x, q, bias, residual=res, config=config, weight_scale=scale)
    assert out.dtype == dtype and (out is res if residual else True)
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert ((out.double() - expected).norm() / expected.norm()).item() < tolerance
    assert int(arrival_counters(x.device, 1).abs().sum()) == 0


def test_skinny_kernel_refuses_fp8_weights_without_a_usable_scale():
    from nanoinfer.kernels import skinny_gemm as sg

    x = torch.randn(2, 32)
    q, scale = fp8.quantize_per_row(torch.randn(24, 32))
    with pytest.raises(ValueError, match="weight dtype"):
        sg.skinny_linear(x, q)
    with pytest.raises(ValueError, match="weight_scale must be float32"):
        sg.skinny_linear(x, q, weight_scale=scale[:8])
    with pytest.raises(ValueError, match="must be torch.float8_e4m3fn"):
        sg.skinny_linear(x, torch.randn(24, 32), weight_scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K", [(1, 64), (7, 200), (3, 5000)])  # 5000: three passes of the kernel's row loop
@kernel_test
def test_quantize_per_token_kernel_is_the_pytorch_math(dtype, M, K):
    from nanoinfer.kernels.fp8 import quantize_per_token

    gen = torch.Generator().manual_seed(K)
    x = (torch.randn(M, K, generator=gen) * torch.rand(M, 1, generator=gen) * 50).to(DEVICE, dtype)
    x[0, :] = 0  # an all-zero row: scale MIN_SCALE, zeros
    wide = torch.zeros(M, K + 8, dtype=dtype, device=DEVICE)
    wide[:, :K] = x
    q, scale = quantize_per_token(wide[:, :K])  # rows of a wider buffer: strided
    rows = x.float()
    want_scale = (rows.abs().amax(dim=1, keepdim=True) / 448).clamp_min(fp8.MIN_SCALE)
    assert q.shape == (M, K) and q.dtype == torch.float8_e4m3fn and scale.shape == (M, 1)
    # An ulp apart at most (PyTorch on CUDA divides a tensor by a number as a multiply by its reciprocal, which can
    # move a value at a tie of two fp8 neighbours): q is checked against the kernel's own scale, bit for bit.
    torch.testing.assert_close(scale, want_scale, rtol=1e-6, atol=0)
    want = (rows.cpu() / scale.cpu()).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.float().cpu(), want.float())
    assert torch.equal(q[0].float(), torch.zeros(K, device=DEVICE))


@kernel_test
def test_quantize_per_token_kernel_rounds_to_nearest_even():
    """A row whose scale is exactly 1 (its largest value is 448): every midpoint between two neighbouring fp8
    values (ties: to the even one), values just either side of them, and random ones convert as PyTorch does."""
    from nanoinfer.kernels.fp8 import quantize_per_token

    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()  # every finite e4m3 value, ascending
    mid = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([torch.tensor([448.0]), mid, mid.nextafter(torch.tensor(1e9)), mid.nextafter(torch.tensor(-1e9)),
                        torch.empty(2000).uniform_(-448, 448, generator=torch.Generator().manual_seed(0))])
    q, scale = quantize_per_token(values[None].to(DEVICE))
    assert scale.item() == 1.0
    assert torch.equal(q.float().cpu(), values.to(torch.float8_e4m3fn).float()[None])


@kernel_test
def test_quantize_per_token_kernel_keeps_a_row_with_nan_or_inf_non_finite():
    """As PyTorch's math: a NaN makes the row's scale NaN, an infinity makes it infinite, so the matmul's row is not
    finite either (its scale multiplies the row). Where PyTorch's value is NaN, Triton's CPU interpreter stores
    384 (its float32 -> fp8 conversion), a GPU NaN: those positions are compared on a GPU only."""
    from nanoinfer.kernels.fp8 import quantize_per_token

    x = torch.randn(4, 3000, generator=torch.Generator().manual_seed(0))
    x[1, 7], x[2, 9], x[3, 5] = float("nan"), float("inf"), -float("inf")
    q, scale = quantize_per_token(x.to(DEVICE))
    _, want_scale = fp8.quantize_per_token(x)  # (on the CPU: the PyTorch math)
    assert scale[0].isfinite().all() and scale[1].isnan().all() and bool((scale[2:] == float("inf")).all())
    torch.testing.assert_close(scale.cpu(), want_scale, rtol=1e-6, atol=0, equal_nan=True)
    want_q = (x / scale.cpu()).clamp(-448, 448).to(torch.float8_e4m3fn)  # (the kernel's scale: see above)
    nan = want_q.float().isnan()
    assert nan.any() and torch.equal(q.float().cpu()[~nan], want_q.float()[~nan])
    if DEVICE == "cuda":
        assert torch.equal(q.float().isnan().cpu(), nan)


# ----- the math on CPU -----


def test_quantize_per_row_maps_each_row_to_448_and_refuses_non_finite_weights():
    w = torch.randn(40, 96) * torch.logspace(-3, 3, 40)[:, None]
    w[7] = 0
    q, scale = fp8.quantize_per_row(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert torch.equal(q.float().abs().amax(dim=1)[torch.arange(40) != 7], torch.full((39,), 448.0))
    assert torch.equal(q[7].float(), torch.zeros(96))
    rel = ((q.float() * scale[:, None] - w).abs().amax(dim=1) / w.abs().amax(dim=1).clamp_min(1e-30))
    assert rel.max() <= 2**-4  # e4m3: 3 mantissa bits, half a step of rounding
    w[3, 5] = float("inf")
    with pytest.raises(ValueError, match="not finite"):
        fp8.quantize_per_row(w)


def test_dense_linear_multiplies_by_the_dequantized_weight():
    """W8A16 on a CPU: x @ (q * scale)^T, then the bias, then into the residual in place."""
    x, w, b = torch.randn(5, 32, dtype=torch.float64).float(), torch.randn(24, 32), torch.randn(24)
    q, scale = fp8.quantize_per_row(w)
    weight = q.float() * scale[:, None]
    torch.testing.assert_close(dispatch.linear(x, q, b, weight_scale=scale), x @ weight.T + b)
    residual = torch.randn(5, 24)
    want = residual + x @ weight.T
    assert dispatch.linear(x, q, None, residual, weight_scale=scale) is residual
    torch.testing.assert_close(residual, want)
    for dtype in (torch.bfloat16, torch.float16):
        low = dispatch.linear(x.to(dtype), q, weight_scale=scale)
        assert low.dtype == dtype
        torch.testing.assert_close(low.float(), x.to(dtype).float() @ weight.T, rtol=2e-2, atol=2e-2)
    # Weights whose rows are small: q alone (448 / row max times the weight) would overflow a float16 product.
    small, x_big = w * 1e-3, torch.randn(5, 32) * 100
    q, scale = fp8.quantize_per_row(small)
    out = dispatch.linear(x_big.half(), q, weight_scale=scale)
    assert out.isfinite().all()
    torch.testing.assert_close(out.float(), x_big.half().float() @ (q.float() * scale[:, None]).T, rtol=2e-2, atol=2e-2)


def test_quantize_per_token_on_cpu_scales_each_row_to_448():
    x = torch.randn(4, 64) * torch.tensor([[1e-3], [1.0], [1e3], [0.0]])
    q, scale = fp8.quantize_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (4, 1)
    assert torch.equal(q.float().abs().amax(dim=1)[:3], torch.full((3,), 448.0))
    assert torch.equal(q[3].float(), torch.zeros(64))
    torch.testing.assert_close(q.float() * scale, x, rtol=2**-4, atol=0)


def test_dequantize_checkpoint_weight_takes_block_row_and_tensor_scales():
    w = torch.randn(40, 70).to(torch.float8_e4m3fn)
    blocks = torch.rand(3, 3) + 0.5  # ceil(40 / 16) x ceil(70 / 32)
    out = fp8.dequantize_checkpoint_weight("w", w, blocks, (16, 32))
    assert torch.equal(out[17, 65], w[17, 65].float() * blocks[1, 2]) and torch.equal(out[0, 0], w[0, 0].float() * blocks[0, 0])
    rows = torch.rand(40, 1)
    assert torch.equal(fp8.dequantize_checkpoint_weight("w", w, rows, None), w.float() * rows)
    assert torch.equal(fp8.dequantize_checkpoint_weight("w", w, torch.tensor(2.0), None), w.float() * 2)
    with pytest.raises(ValueError, match="fits neither"):
        fp8.dequantize_checkpoint_weight("w", w, torch.rand(2, 3), (16, 32))
    with pytest.raises(ValueError, match="not finite"):
        fp8.dequantize_checkpoint_weight("w", w, torch.tensor(float("inf")), None)


def test_resolve_quantization():
    class Config:
        pass

    plain, quantized, other = Config(), Config(), Config()
    quantized.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    other.quantization_config = {"quant_method": "awq", "bits": 4}
    assert fp8.resolve_quantization(None, plain) is None
    assert fp8.resolve_quantization("fp8", plain) == "fp8"
    assert fp8.resolve_quantization(None, quantized) == "fp8" and fp8.checkpoint_block_size(quantized) == (128, 128)
    with pytest.raises(ValueError, match="quant_method='awq'"):
        fp8.resolve_quantization(None, other)
    with pytest.raises(ValueError, match="not supported"):
        fp8.resolve_quantization("int4", plain)
    quantized.quantization_config["weight_block_size"] = [128]
    with pytest.raises(ValueError, match="weight_block_size"):
        fp8.checkpoint_block_size(quantized)
    other.quantization_config = compressed_tensors_config("block")
    assert fp8.resolve_quantization(None, other) == "fp8" and fp8.checkpoint_block_size(other) == (16, 32)
    other.quantization_config = compressed_tensors_config("channel")
    assert fp8.resolve_quantization(None, other) == "fp8" and fp8.checkpoint_block_size(other) is None
    other.quantization_config["config_groups"]["group_1"] = compressed_tensors_config("tensor", 4, "int")["config_groups"]["group_0"]
    with pytest.raises(ValueError, match="'group_1' stores 4-bit int weights"):
        fp8.resolve_quantization(None, other)


def test_a_model_to_quantize_is_built_with_its_projection_weights_in_host_memory():
    """On a GPU (here the meta device stands for it) the projections' full-precision weights are built on the host,
    everything else on the device; quantize_fp8 moves each weight to the device as fp8, so the device never holds
    the model in its dtype."""
    from nanoinfer.layers.linear import ColumnParallelLinear

    with torch.device("meta"), fp8.weights_on_host(True):
        layer = ColumnParallelLinear(32, 24, bias=True)
        norm = torch.nn.Linear(2, 2)
    assert layer.weight.device.type == "cpu" and layer.bias.device.type == "meta" and norm.weight.device.type == "meta"
    layer.weight.data.normal_()
    layer.fold_norm(torch.full((32,), 2.0))  # (the fold runs where W is: on a GPU, the norm's weight comes over)
    layer.quantize_fp8(torch.device("cpu"))
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (24,)
    with torch.device("meta"):
        assert ColumnParallelLinear(32, 24).weight.device.type == "meta"  # (outside the context: the device)


# ----- the engine -----


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp8_output_equals_transformers_on_the_dequantized_weights(models, arch):
    from test_e2e import hf_greedy

    case = models[arch]
    llm = LLM(case["base"], quantization="fp8", block_size=4, device="cpu")
    linears = [m for m in engine_model(llm).modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.dtype == torch.float8_e4m3fn and m.weight_scale.dtype == torch.float32
                           for m in linears)
    assert engine_model(llm).model.embed_tokens.weight.dtype == torch.float32  # the embedding stays as it is
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == hf_greedy(case["reference"], PROMPTS, NUM_TOKENS)


def test_lora_adapters_on_fp8_weights_equal_the_merged_reference(models, tmp_path):
    """The adapter is added to the fp8 base layer's output in full precision: the merged reference is the
    dequantized base plus B A."""
    from test_e2e import hf_greedy
    from test_lora import make_adapter, merge

    case = models["qwen3"]
    adapter = make_adapter(tmp_path / "a", case["base"], seed=1)
    llm = LLM(case["base"], quantization="fp8", enable_lora=True, block_size=4, device="cpu")
    ours = token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False, lora_request=LoRARequest("a", 1, adapter)))
    assert ours == hf_greedy(merge(case["reference"], adapter, tmp_path / "merged"), PROMPTS, NUM_TOKENS)


def compressed_tensors_config(strategy: str, num_bits: int = 8, kind: str = "float") -> dict:
    """llm-compressor's quantization_config for its FP8-dynamic scheme (weights `strategy`, activations per token)."""
    weights = {"num_bits": num_bits, "type": kind, "strategy": strategy, "symmetric": True, "dynamic": False}
    if strategy == "block":
        weights["block_structure"] = [16, 32]
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": {
                "num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}, "kv_cache_scheme": None}


def write_fp8_checkpoint(base: str, folder, scheme: str, compressed_tensors: bool = False) -> tuple[str, str]:
    """`base` saved as an fp8 checkpoint (`scheme`: "block" 16 x 32 scales in weight_scale_inv, as DeepSeek /
    Qwen ship them; "row" or "tensor" weight_scale plus an input_scale, as AutoFP8's; `compressed_tensors`: as
    llm-compressor saves them, every scale in weight_scale, with KV-cache scales), and a float32 folder of what it
    dequantizes to. Returns (fp8 folder, dequantized folder)."""
    tensors = load_file(os.path.join(base, "model.safetensors"))
    fp8_tensors, dequantized = {}, {}
    for name, t in tensors.items():
        if not name.endswith("_proj.weight"):
            fp8_tensors[name] = dequantized[name] = t
            continue
        module = name.removesuffix(".weight")
        if scheme == "block":
            blocks = t.unflatten(0, (-1, 16)).unflatten(2, (-1, 32)).abs().amax(dim=(1, 3)) / 448
            scale_full = blocks.repeat_interleave(16, 0).repeat_interleave(32, 1)
            fp8_tensors[f"{module}.weight_scale" if compressed_tensors else f"{module}.weight_scale_inv"] = blocks
        else:
            scale_full = t.abs().amax(dim=1, keepdim=True) / 448 if scheme == "row" else t.abs().amax() / 448
            fp8_tensors[f"{module}.weight_scale"] = scale_full
            fp8_tensors[f"{module}.input_scale"] = torch.tensor(0.5)
        if compressed_tensors and name.endswith("k_proj.weight"):
            attention = module.removesuffix(".k_proj")
            fp8_tensors[f"{attention}.k_scale"], fp8_tensors[f"{attention}.v_scale"] = torch.tensor(0.1), torch.tensor(0.2)
        q = (t / scale_full).to(torch.float8_e4m3fn)
        fp8_tensors[name] = q
        dequantized[name] = q.float() * scale_full
    paths = []
    for suffix, weights, quantized in (("fp8", fp8_tensors, True), ("deq", dequantized, False)):
        path = f"{folder}-{scheme}-{suffix}"
        os.makedirs(path)
        save_file(weights, os.path.join(path, "model.safetensors"))
        with open(os.path.join(base, "config.json")) as f:
            config = json.load(f)
        if quantized and compressed_tensors:
            config["quantization_config"] = compressed_tensors_config({"row": "channel"}.get(scheme, scheme))
        elif quantized:
            config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"} | (
                {"weight_block_size": [16, 32]} if scheme == "block" else {})
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
        paths.append(path)
    return paths[0], paths[1]


@pytest.mark.parametrize("scheme,compressed_tensors", [("block", False), ("row", False), ("tensor", False),
                                                       ("block", True), ("row", True), ("tensor", True)])
def test_an_fp8_checkpoint_loads_as_its_dequantized_weights(models, tmp_path, scheme, compressed_tensors, caplog):
    """Loaded without quantization=: the checkpoint's quantization_config says fp8; the engine's model then
    equals an fp8 engine on the dequantized float32 folder, bit for bit. A compressed-tensors checkpoint's KV-cache
    scales are left unused, with a warning."""
    quantized, dequantized = write_fp8_checkpoint(models["qwen3"]["base"], tmp_path / "ckpt", scheme,
                                                  compressed_tensors)
    ours = LLM(quantized, block_size=4, device="cpu")
    reference = LLM(dequantized, quantization="fp8", block_size=4, device="cpu")
    for (name, a), (_, b) in zip(engine_model(ours).named_modules(), engine_model(reference).named_modules()):
        if isinstance(a, LinearBase):
            assert a.weight.dtype == torch.float8_e4m3fn
            assert torch.equal(a.weight.float(), b.weight.float()) and torch.equal(a.weight_scale, b.weight_scale), name
    assert token_ids(ours.generate(PROMPTS, greedy(), use_tqdm=False)) == \
        token_ids(reference.generate(PROMPTS, greedy(), use_tqdm=False))
    assert ("KV-cache scales" in caplog.text) is compressed_tensors


def test_bad_quantized_checkpoints_are_clear_errors(models, tmp_path):
    base = models["qwen3"]["base"]
    quantized, _ = write_fp8_checkpoint(base, tmp_path / "ckpt", "block")

    def edited(name: str, config_change=None, tensors_change=None) -> str:
        path = tmp_path / name
        shutil.copytree(quantized, path)
        config = json.loads((path / "config.json").read_text())
        if config_change:
            config_change(config)
        (path / "config.json").write_text(json.dumps(config))
        if tensors_change:
            tensors = load_file(path / "model.safetensors")
            tensors_change(tensors)
            save_file(tensors, path / "model.safetensors")
        return str(path)

    awq = edited("awq", lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 4}))
    with pytest.raises(ValueError, match="quant_method='awq'"):
        LLM(awq, device="cpu")
    int4 = edited("w4a16", lambda c: c.update(quantization_config=compressed_tensors_config("group", 4, "int")))
    with pytest.raises(ValueError, match="stores 4-bit int weights: nanoinfer loads 8-bit float"):
        LLM(int4, device="cpu")
    no_block = compressed_tensors_config("block")
    del no_block["config_groups"]["group_0"]["weights"]["block_structure"]
    with pytest.raises(ValueError, match="gives no block_structure"):
        LLM(edited("ct-no-block", lambda c: c.update(quantization_config=no_block)), device="cpu")
    with pytest.raises(ValueError, match="has no fp8 quantization_config"):
        LLM(edited("no-config", lambda c: c.pop("quantization_config")), device="cpu")
    scale = "model.layers.0.mlp.down_proj.weight_scale_inv"
    with pytest.raises(ValueError, match="down_proj.weight' has no scale"):
        LLM(edited("no-scale", tensors_change=lambda t: t.pop(scale)), device="cpu")
    with pytest.raises(ValueError, match="fits neither"):
        LLM(edited("bad-scale", tensors_change=lambda t: t.update({scale: t[scale][:1]})), device="cpu")
    with pytest.raises(ValueError, match="not finite"):
        LLM(edited("inf-scale", tensors_change=lambda t: t[scale].fill_(float("inf"))), device="cpu")
    with pytest.raises(ValueError, match="quantization='int4' is not one of"):
        LLM(base, quantization="int4", device="cpu")
    down = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=r"\['model.layers.0.mlp.down_proj.weight_scale_inv'\] belong to weights that are not float8"):
        LLM(edited("scale-of-bf16", tensors_change=lambda t: t.update({down: t[down].bfloat16()})), device="cpu")
    with pytest.raises(ValueError, match="layers.5.mlp.down_proj.weight_scale_inv' is the scale of a weight the checkpoint"):
        LLM(edited("stray-scale", tensors_change=lambda t: t.update({scale.replace(".0.", ".5."): t[scale].clone()})), device="cpu")
    with pytest.raises(ValueError, match=r"down_proj.weight' has two scales"):
        LLM(edited("two-scales", tensors_change=lambda t: t.update({down + "_scale": t[scale].max().reshape(1)})),
            device="cpu")
    with pytest.raises(ValueError, match="is torch.int8: weights must be floating point"):
        LLM(edited("int8", tensors_change=lambda t: t.update({down: t[down].view(torch.int8)})), device="cpu")
    with pytest.raises(ValueError, match="float8_e5m2: fp8 weights must be torch.float8_e4m3fn"):
        LLM(edited("e5m2", tensors_change=lambda t: t.update({down: t[down].float().to(torch.float8_e5m2)})),
            device="cpu")


def test_a_float8_bias_is_a_clear_error(tiny_models, tmp_path):
    quantized, _ = write_fp8_checkpoint(tiny_models["qwen2"], tmp_path / "qwen2", "row")  # (q/k/v biases)
    bias = "model.layers.0.self_attn.q_proj.bias"
    tensors = load_file(os.path.join(quantized, "model.safetensors"))
    tensors[bias] = tensors[bias].to(torch.float8_e4m3fn)
    save_file(tensors, os.path.join(quantized, "model.safetensors"))
    with pytest.raises(ValueError, match="q_proj.bias' is float8, but only weights are quantized"):
        LLM(quantized, device="cpu")


def test_tp2_fp8_equals_tp1(models):
    """A row-parallel rank holds part of each row: the row's scale is still the whole row's (an all-reduce max at
    load), so the fp8 weights and the outputs are TP=1's."""
    kwargs = dict(device="cpu", quantization="fp8", block_size=4, num_kv_blocks=64)
    single = LLM(models["qwen3"]["base"], **kwargs)
    reference = token_ids(single.generate(PROMPTS, greedy(), use_tqdm=False))
    single.close()
    llm = LLM(models["qwen3"]["base"], tensor_parallel_size=2, **kwargs)
    try:
        assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == reference
    finally:
        llm.close()
    assert not dist.is_initialized()


def test_tp2_refuses_a_weight_that_is_not_finite_on_every_rank(models, tmp_path):
    """A NaN in the second rank's shard of a column-parallel weight: every rank refuses it (they agree at load),
    so the engine raises the reason instead of a rank waiting for a peer that left."""
    folder = tmp_path / "nan"
    shutil.copytree(models["qwen3"]["base"], folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.self_attn.q_proj.weight"][-1, 0] = float("nan")  # (rank 1 holds the last rows)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="qkv_proj: cannot quantize a weight that is not finite"):
        LLM(str(folder), device="cpu", quantization="fp8", tensor_parallel_size=2, num_kv_blocks=32)
    assert not dist.is_initialized()



def test_fp8_weights_are_refused_on_gpus_without_fp8_conversions(monkeypatch):
    """Our kernels convert fp8 as they load it, which Triton compiles only for compute capability 8.9+: an older GPU
    is refused before anything is built (it would fail as the first kernel compiles)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability 8.9 or newer \(Ada, Hopper\); NVIDIA A100 is 8.0"):
        fp8.check_fp8_device(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fp8.check_fp8_device(torch.device("cuda"))
    fp8.check_fp8_device(torch.device("cpu"))
