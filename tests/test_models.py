"""Model code, parallel layers and weight loading, checked against Hugging Face.

Tiny random HF models are saved as safetensors, loaded with `load_model`, and
run through our paged-attention path (reference backend, scrambled block
tables). Every position's float32 logits must match HF's within TOL, for the
prefill and for one decode step that reads the cached K/V.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig,
                          Qwen3Config, Qwen3MoeConfig)

import nanoinfer.layers.linear as linear_module
from nanoinfer.attention.metadata import AttentionMetadata, set_forward_context
from nanoinfer.attention.torch_backend import TorchAttentionBackend
from nanoinfer.distributed.parallel_state import tp_world_size
from nanoinfer.layers.attention import bind_kv_cache
from nanoinfer.layers.rotary import get_rope, get_rope_parameters
from nanoinfer.loader.weights import get_hf_config, load_model

TOL = 1e-4  # max abs logit difference vs HF, float32
BLOCK_SIZE = 4
NUM_BLOCKS = 32
PROMPT_LENS = [5, 9, 3]
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,  # small, so head_dim 16 has low, medium and high frequencies
)
# Small original contexts and rotation bounds, so that head_dim 16 has interpolated, ramped and kept dimensions.
YARN_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                 beta_fast=8.0, beta_slow=0.5)


def save_tiny_model(folder: Path, config_class, max_shard_size: str | None = None, **overrides):
    """A random HF model, perturbed so norms and biases are not the trivial 1 and 0, saved to `folder`."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config_class(**{**TINY, **overrides}), attn_implementation="eager")
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return hf.eval()


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


class PagedRunner:
    """A minimal stand-in for the model runner: one KV cache, block tables handed out in a
    scrambled order, and per-step AttentionMetadata for sequences that grow step by step."""

    def __init__(self, model, hf_config, num_seqs: int) -> None:
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        num_kv_heads = hf_config.num_key_value_heads // tp_world_size()
        self.kv_cache = torch.zeros(2, hf_config.num_hidden_layers, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
        bind_kv_cache(model, self.kv_cache, TorchAttentionBackend())
        order = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1))
        self.block_tables = order[: num_seqs * (NUM_BLOCKS // num_seqs)].view(num_seqs, -1).int()
        self.model, self.seq_lens = model, [0] * num_seqs

    def step(self, new_tokens: list[list[int]]) -> torch.Tensor:
        """Run each sequence's new tokens; returns logits for all of them, flattened."""
        ids, positions, slots, starts = [], [], [], [0]
        for i, tokens in enumerate(new_tokens):
            for pos in range(self.seq_lens[i], self.seq_lens[i] + len(tokens)):
                positions.append(pos)
                slots.append(int(self.block_tables[i, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
            ids += tokens
            self.seq_lens[i] += len(tokens)
            starts.append(starts[-1] + len(tokens))
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32),
            block_tables=self.block_tables,
            max_query_len=max(len(t) for t in new_tokens),
            max_seq_len=max(self.seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=list(self.seq_lens),
        )
        with torch.inference_mode(), set_forward_context(metadata):
            hidden = self.model(torch.tensor(ids), torch.tensor(positions))
            return self.model.compute_logits(hidden)


def random_prompts(vocab_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of PROMPT_LENS tokens and one decode token per sequence."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return prompts, [torch.randint(vocab_size, (1,), generator=g).tolist() for _ in PROMPT_LENS]


def prefill_and_decode(model, hf_config, prompts, decode_tokens) -> tuple[torch.Tensor, torch.Tensor]:
    runner = PagedRunner(model, hf_config, len(prompts))
    return runner.step(prompts), runner.step(decode_tokens)


def assert_matches_hf(hf, prompts, decode_tokens, prefill: torch.Tensor, decode: torch.Tensor) -> None:
    expected_prefill = torch.cat([hf_logits(hf, p) for p in prompts])
    expected_decode = torch.stack([hf_logits(hf, p + d)[-1] for p, d in zip(prompts, decode_tokens)])
    assert prefill.dtype == torch.float32 and prefill.shape == expected_prefill.shape
    assert (prefill - expected_prefill).abs().max() < TOL
    assert (decode - expected_decode).abs().max() < TOL


CASES = {
    "llama-sharded-theta500": (LlamaConfig, "20KB", dict(rope_theta=500.0)),
    "llama-1kv-bias": (LlamaConfig, None, dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True)),
    "llama3-rope": (LlamaConfig, None, dict(rope_parameters=LLAMA3_ROPE)),
    "llama-linear-rope": (LlamaConfig, None, dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0,
                                                                       factor=2.0))),
    "qwen3-yarn-rope": (Qwen3Config, None, dict(rope_parameters=YARN_ROPE)),
    "mistral": (MistralConfig, None, dict(sliding_window=None)),
    "qwen2-qkv-bias": (Qwen2Config, None, {}),
    "qwen3-tied-headdim32": (Qwen3Config, None, dict(tie_word_embeddings=True, head_dim=32)),
    # Mixture of experts: a sparse layer and a dense one (`decoder_sparse_step`), renormalised top-k; Mixtral.
    "qwen3-moe-sharded": (Qwen3MoeConfig, "20KB", dict(head_dim=16, num_experts=8, num_experts_per_tok=3,
                                                       moe_intermediate_size=24, decoder_sparse_step=2,
                                                       norm_topk_prob=True)),
    "mixtral": (MixtralConfig, None, dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "qwen2-moe-shared-expert": (Qwen2MoeConfig, None, dict(num_experts=8, num_experts_per_tok=2,
                                                          moe_intermediate_size=24,
                                                          shared_expert_intermediate_size=40)),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_hf_prefill_and_decode(case, tmp_path):
    config_class, max_shard_size, overrides = CASES[case]
    hf = save_tiny_model(tmp_path, config_class, max_shard_size, **overrides)
    assert (tmp_path / "model.safetensors.index.json").exists() == (max_shard_size is not None)
    hf_config = get_hf_config(tmp_path)
    model = load_model(str(tmp_path), hf_config, "safetensors", torch.float32, torch.device("cpu"))
    if hf_config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    prompts, decode_tokens = random_prompts(hf_config.vocab_size)
    assert_matches_hf(hf, prompts, decode_tokens, *prefill_and_decode(model, hf_config, prompts, decode_tokens))


def _tp_worker(rank: int, world_size: int, folder: str, init_file: str, out_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        hf_config = get_hf_config(folder)
        model = load_model(folder, hf_config, "safetensors", torch.float32, torch.device("cpu"))
        prompts, decode_tokens = random_prompts(hf_config.vocab_size)
        prefill, decode = prefill_and_decode(model, hf_config, prompts, decode_tokens)
        torch.save({"prefill": prefill, "decode": decode, "qkv_rows": model.model.layers[0].self_attn.qkv_proj.weight.shape[0]},
                   f"{out_file}.{rank}")
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_2_ranks_matches_hf(tmp_path):
    """Two gloo ranks on CPU: sharded loading, row all-reduce (with bias), a vocabulary that
    does not split evenly (padded) and tied embeddings, gathered into full logits on rank 0
    only (the rank that samples)."""
    folder = tmp_path / "model"
    hf = save_tiny_model(folder, LlamaConfig, vocab_size=255, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)
    mp.spawn(_tp_worker, args=(2, str(folder), str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2)
    prompts, decode_tokens = random_prompts(255)
    outs = [torch.load(f"{tmp_path / 'out'}.{rank}") for rank in range(2)]
    assert all(out["qkv_rows"] == (4 + 2 * 2) * 16 // 2 for out in outs)
    assert outs[0]["prefill"].shape[-1] == 255
    assert_matches_hf(hf, prompts, decode_tokens, outs[0]["prefill"], outs[0]["decode"])
    assert outs[1]["prefill"] is None and outs[1]["decode"] is None


def _write_config(folder: Path, **fields) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY}
    (folder / "config.json").write_text(json.dumps({**base, **fields}))
    return folder


def test_rope_theta_and_rope_parameters_forms(tmp_path):
    """transformers 4 style (`rope_theta`, `rope_scaling`) and transformers 5 style (`rope_parameters`)
    configs, as files and as objects, give the same RoPE."""
    old_file = get_hf_config(_write_config(tmp_path / "old", rope_theta=500.0))
    new_file = get_hf_config(_write_config(tmp_path / "new", rope_parameters={"rope_type": "default", "rope_theta": 500.0}))
    old_object = SimpleNamespace(rope_theta=500.0, rope_scaling=None)
    for config in (old_file, new_file, old_object):
        assert get_rope_parameters(config) == {"rope_type": "default", "rope_theta": 500.0}
    llama3_old = get_hf_config(_write_config(tmp_path / "llama3", rope_theta=10000.0, rope_scaling=LLAMA3_ROPE))
    assert get_rope_parameters(llama3_old) == LLAMA3_ROPE
    caches = [get_rope(16, 64, c).cos_cache for c in (old_file, new_file, old_object, SimpleNamespace())]
    assert torch.equal(caches[0], caches[1]) and torch.equal(caches[0], caches[2])
    assert not torch.allclose(caches[0], caches[3])  # the default theta (10000) differs
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'dynamic'.*llama3, yarn"):
        get_rope(16, 64, SimpleNamespace(rope_theta=1e4, rope_scaling={"type": "dynamic", "factor": 4.0}))
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        get_rope(16, 64, SimpleNamespace(rope_theta=1e4, rope_scaling={"partial_rotary_factor": 0.5}))


@pytest.mark.parametrize("rope", [
    YARN_ROPE,
    dict(YARN_ROPE, attention_factor=0.8, truncate=False),
    dict(YARN_ROPE, mscale=0.707, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0, rope_theta=1e6),  # DeepSeek's form
    dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32768),  # Qwen3's 128k setting
    dict(rope_type="linear", rope_theta=10000.0, factor=8.0),
    LLAMA3_ROPE,
])
def test_rope_scaling_matches_transformers(rope):
    """The cos / sin tables equal cos / sin of transformers' frequencies times its attention factor."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Qwen3Config(**{**TINY, "max_position_embeddings": 4 * rope.get("original_max_position_embeddings", 16)},
                         head_dim=16, rope_parameters=dict(rope))
    inv_freq, attention = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    ours = get_rope(16, config.max_position_embeddings, config)
    freqs = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float), inv_freq)
    torch.testing.assert_close(ours.cos_cache, freqs.cos() * attention, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.sin_cache, freqs.sin() * attention, rtol=1e-5, atol=1e-5)
    assert (rope["rope_type"] == "yarn") == (abs(attention - 1.0) > 1e-3)


def test_dummy_load_from_config_alone(tmp_path):
    folder = _write_config(tmp_path, head_dim=16)
    for source in (folder, folder / "config.json"):
        hf_config = get_hf_config(source)
        assert hf_config.architectures == ["LlamaForCausalLM"]
    a = load_model(str(folder), hf_config, "dummy", torch.float32, torch.device("cpu"))
    b = load_model(None, hf_config, "dummy", torch.float32, torch.device("cpu"))
    shapes = {name: tuple(p.shape) for name, p in a.named_parameters()}
    assert shapes["model.embed_tokens.weight"] == (256, 64)
    assert shapes["model.layers.1.self_attn.qkv_proj.weight"] == ((4 + 2 * 2) * 16, 64)
    assert shapes["model.layers.1.mlp.gate_up_proj.weight"] == (2 * 128, 64)
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (64, 128)
    assert shapes["lm_head.weight"] == (256, 64)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.isfinite(pa).all() and pa.std() > 0, name
        if name.endswith("norm.weight"):
            assert 0.9 <= pa.min() and pa.max() <= 1.1, name
        elif name.endswith("embed_tokens.weight"):  # fan-in = hidden size: unit-norm rows on average
            assert pa.abs().max() <= (3 / 64) ** 0.5 and 0.8 < pa.pow(2).sum(1).mean() < 1.2, name
        assert torch.equal(pa, pb), name  # same seed, same values
    bf16 = load_model(None, hf_config, "dummy", torch.bfloat16, torch.device("cpu"))
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    prefill, decode = prefill_and_decode(bf16, hf_config, *random_prompts(256))
    assert prefill.dtype == torch.bfloat16 and prefill.shape == (sum(PROMPT_LENS), 256)  # the model's dtype
    assert torch.isfinite(prefill).all() and torch.isfinite(decode).all()


def test_unknown_architecture(tmp_path):
    hf_config = get_hf_config(_write_config(tmp_path, architectures=["FooForCausalLM"]))
    with pytest.raises(ValueError, match=r"FooForCausalLM.*supported: .*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(None, hf_config, "dummy", torch.float32, torch.device("cpu"))


def test_missing_unexpected_and_misshaped_weights(tmp_path):
    save_tiny_model(tmp_path, LlamaConfig)
    hf_config = get_hf_config(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    good = dict(weights)
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing weights \['model.layers.1.mlp.up_proj.weight'\], "
                                         r"unexpected weights \['model.layers.0.self_attn.extra.weight'\]"):
        load_model(str(tmp_path), hf_config, "safetensors", torch.float32, torch.device("cpu"))
    good["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(good, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' of shape \(16, 64\)"):
        load_model(str(tmp_path), hf_config, "safetensors", torch.float32, torch.device("cpu"))


def test_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_hf_config(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        get_hf_config(tmp_path / "empty")
    hf_config = get_hf_config(_write_config(tmp_path / "config_only"))
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors weights"):
        load_model(str(tmp_path / "config_only"), hf_config, "auto", torch.float32, torch.device("cpu"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope"), hf_config, "safetensors", torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown load_format 'pt'"):
        load_model(str(tmp_path / "config_only"), hf_config, "pt", torch.float32, torch.device("cpu"))


def test_heads_not_divisible_by_tp(tmp_path, monkeypatch):
    monkeypatch.setattr(linear_module, "tp_world_size", lambda: 2)
    hf_config = get_hf_config(_write_config(tmp_path, hidden_size=96, num_attention_heads=6, num_key_value_heads=3))
    with pytest.raises(ValueError, match=r"size 2 .*num_attention_heads=6 and num_key_value_heads=3.*\[1, 3\]"):
        load_model(None, hf_config, "dummy", torch.float32, torch.device("cpu"))


def test_cpu_engine_imports_without_triton():
    """Triton is optional (the `triton` extra): the model, the runner and the sampler import on a
    machine without it; kernels are imported only where CUDA runs them."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import nanoinfer.models.llama, nanoinfer.model_runner.model_runner, nanoinfer.sample.sampler\n"
            "import nanoinfer.engine.llm\n"
            "print('imported')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-3000:]


def test_tp_partial_outputs_sum_with_the_residual_in_alternating_slots(tmp_path, monkeypatch):
    """Under TP each row-parallel layer, and the vocab-parallel embedding, sums its partial output over the
    ranks together with the residual stream (one fused kernel on GPUs). The kernel buffers per slot, so
    consecutive calls must use different slots, within a forward and across forwards: here a stand-in kernel
    records the slots of two forwards (the embedding, then 2 per layer) and returns what one rank's sum is, so
    the logits still match HF."""
    from nanoinfer.layers import linear as linear_layers
    from nanoinfer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from nanoinfer.layers.linear import RowParallelLinear

    hf = save_tiny_model(tmp_path, Qwen3Config, None)
    hf_config = get_hf_config(tmp_path)
    model = load_model(str(tmp_path), hf_config, "safetensors", torch.float32, torch.device("cpu"))
    slots: list[int] = []

    class RecordingKernel:
        def fits(self, x: torch.Tensor) -> bool:
            return True

        def __call__(self, partial, residual, slot):
            slots.append(slot)
            return partial if residual is None else partial + residual  # the sum over one rank is its partial

    for module in model.modules():  # take the TP path with one rank's whole weights
        if isinstance(module, (RowParallelLinear, VocabParallelEmbedding)) and not isinstance(module, ParallelLMHead):
            module.tp_size = 2
    monkeypatch.setattr(linear_layers, "fused_all_reduce", lambda: RecordingKernel())
    prompts, decode_tokens = random_prompts(hf_config.vocab_size)
    prefill, decode = prefill_and_decode(model, hf_config, prompts, decode_tokens)
    forward = [2] + [0, 1] * hf_config.num_hidden_layers
    assert slots == forward * 2
    assert all(a != b for a, b in zip(slots, slots[1:]))
    assert_matches_hf(hf, prompts, decode_tokens, prefill, decode)
