"""The Llama decoder family in one implementation: Llama 2/3, SmolLM2, Mistral,
Qwen2, Qwen3, and the mixture-of-experts Qwen3-MoE, Qwen2-MoE and Mixtral differ only
in flags read from the HF config:

* `attention_bias` (Llama, Qwen3): bias on q/k/v/o; Qwen2 always has a q/k/v bias and none on o, whatever
  its config says (a config converted from a Qwen2 GGUF says true), Qwen2-MoE as its `qkv_bias` says;
  `mlp_bias`: Llama's only;
* Qwen3 (and Qwen3-MoE) normalises each query and key head (RMSNorm over head_dim) before RoPE;
* `tie_word_embeddings`: the LM head reuses the embedding matrix;
* Qwen3-MoE, Qwen2-MoE and Mixtral replace the MLP by a sparse MoE block (layers/moe.py) in every layer
  that `is_moe_layer` names (Mixtral's checkpoints call it `block_sparse_moe`: `checkpoint_substrings`);
  Qwen2-MoE's block adds a gated shared expert, a dense MLP every token goes through.

Tokens of all sequences arrive flattened (`[T]` ids and positions); attention
finds the batch layout in the forward context set by the model runner.

The decoder's norms run no kernel of their own: each is folded into the
projection after it (`fold_norms`, once the weights are loaded), and the
row-parallel projections add into the residual stream (layers/linear.py).
An MoE block's input norm is the exception: its router and experts share one
norm kernel.
Module names mirror the HF checkpoints so the loader maps names 1:1, except
the fused projections listed in `packed_modules_mapping` and `checkpoint_substrings`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanoinfer.layers.activation import SiluAndMul
from nanoinfer.layers.attention import Attention
from nanoinfer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoinfer.layers.moe import SparseMoeBlock, is_moe_layer
from nanoinfer.layers.rotary import RotaryEmbedding, get_rope


def _check_supported(config: Any) -> None:
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only 'silu' is implemented")


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        attention_bias = getattr(config, "attention_bias", False)
        if config.model_type == "qwen2_moe":  # (its config says so, as `qkv_bias`; older ones do not: then it has one)
            qkv_bias, o_bias = getattr(config, "qkv_bias", True), False
        else:
            qwen2 = config.model_type == "qwen2"
            qkv_bias, o_bias = attention_bias or qwen2, attention_bias and not qwen2
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, num_heads, num_kv_heads, bias=qkv_bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size, bias=o_bias, all_reduce_slot=0)
        if config.model_type in ("qwen3", "qwen3_moe"):
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim, head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, eps: float) -> torch.Tensor:
        """The residual stream `hidden` plus attention over its RMSNorm (whose weight the QKV projection holds)."""
        qkv, input_norm = self.qkv_proj(hidden, eps)
        out = self.attn(positions, qkv, input_norm, self.rotary_emb, self.q_norm, self.k_norm)
        return self.o_proj(out, residual=hidden)


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, intermediate_size: int | None = None) -> None:
        """intermediate_size: config.intermediate_size unless given (Qwen2-MoE's shared expert has its own)."""
        super().__init__()
        intermediate_size = intermediate_size or config.intermediate_size
        bias = getattr(config, "mlp_bias", False) and config.model_type == "llama"  # (the others' MLPs have none)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size, bias=bias, all_reduce_slot=1)
        self.act_fn = SiluAndMul()

    def forward(self, hidden: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """The residual stream `hidden` plus the MLP of its RMSNorm `norm` (whose weight gate_up holds)."""
        gate_up, deferred = self.gate_up_proj(hidden, norm.eps)
        return self.down_proj(self.act_fn(gate_up, deferred), residual=hidden)

    def partial(self, hidden: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """This rank's part of the MLP of `hidden`'s RMSNorm, unsummed and without the residual (an MoE block adds
        it to its experts' part: `SparseMoeBlock`'s shared expert)."""
        gate_up, deferred = self.gate_up_proj(hidden, norm.eps)
        return self.down_proj.partial(self.act_fn(gate_up, deferred))

    def fold_norm(self, norm_weight: torch.Tensor) -> None:
        self.gate_up_proj.fold_norm(norm_weight)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary_emb)
        if is_moe_layer(config, layer_idx):
            shared = getattr(config, "shared_expert_intermediate_size", 0)  # (Qwen2-MoE's)
            self.mlp = SparseMoeBlock(config, all_reduce_slot=1,
                                      shared_expert=LlamaMLP(config, shared) if shared else None)
        else:
            self.mlp = LlamaMLP(config)
        # Checkpoint weights folded into the projections after them (`fold_norms`); eps stays here.
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The residual stream in, updated (in place on one GPU) out."""
        hidden = self.self_attn(positions, hidden, self.input_layernorm.eps)
        return self.mlp(hidden, self.post_attention_layernorm)

    def fold_norms(self) -> None:
        self.self_attn.qkv_proj.fold_norm(self.input_layernorm.weight)
        self.mlp.fold_norm(self.post_attention_layernorm.weight)


class LlamaModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, all_reduce_slot=2)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # One cos/sin table shared by every layer.
        rotary_emb = get_rope(head_dim, config.max_position_embeddings, config)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary_emb, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    # Fused parameter -> the checkpoint tensors it is made of, with each one's shard_id.
    packed_modules_mapping = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }
    # Checkpoint name parts that are ours under another name: Mixtral's MoE block is our (and transformers 5's) mlp.
    checkpoint_substrings = {".block_sparse_moe.": ".mlp."}

    def __init__(self, config: Any) -> None:
        super().__init__()
        _check_supported(config)
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.norms_folded = False

    def process_weights_after_loading(self) -> None:
        """Once, after the checkpoint (or dummy weights) is loaded: fold each decoder norm into the projection
        after it."""
        if self.norms_folded:
            raise RuntimeError("the model's norms are folded already: its weights were processed once")
        for layer in self.model.layers:
            layer.fold_norms()
        self.norms_folded = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden_size]."""
        if not self.norms_folded:  # the decoder's norms would be missing their weights
            raise RuntimeError("call process_weights_after_loading() once the weights are loaded")
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[n, hidden_size] -> logits [n, vocab_size] in the model's dtype on rank 0 (None on other TP
        ranks). The sampler upcasts where its math needs float32; greedy and plain-temperature
        sampling read them as they are (a float32 copy of [256, 151936] costs ~60 us per step)."""
        return self.lm_head(hidden_states)
