"""Engine arguments: one dataclass, validated once, shared by the `LLM` API,
the CLI (each field becomes a `--flag`) and the server."""

from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass, field
from typing import Any

from nanoinfer.sample.think import REASONING_PARSERS


# Token budgets per step (vLLM's defaults): the server's steps, and an offline engine's on a large GPU,
# where fewer, larger prefill chunks pay less per-step launch overhead (bench/RESULTS.md).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
OFFLINE_LARGE_GPU_MAX_NUM_BATCHED_TOKENS = 16384


def _arg(default: Any, help: str, choices: tuple | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


def read_chat_template(value: str | os.PathLike) -> str:
    """The template in a file, or `value` itself when it is one (vLLM's --chat-template takes either), checked
    now rather than at the first chat request. A template loops over the messages, so it holds a Jinja tag: that
    tells a template from a path, and the text read from a file passes this again (the config is copied with
    replace())."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"chat_template must be a str or a path, got {type(value).__name__}")
    is_file = os.path.isfile(value)
    if is_file:
        with open(value, encoding="utf-8") as f:
            template = f.read()
    else:
        template = os.fspath(value)
    if "{{" not in template and "{%" not in template:
        raise ValueError(f"chat_template file {os.fspath(value)!r} holds no Jinja template" if is_file else
                         f"chat_template {template!r:.200} is neither a file nor a Jinja template")
    return check_chat_template(template)


def check_chat_template(template: object) -> str:
    """A Jinja chat template's text checked for syntax (a request's own template: never read as a path)."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    if not isinstance(template, str):
        raise TypeError(f"chat_template must be a str (a Jinja template), got {type(template).__name__}")
    try:  # transformers' own environment (its extensions, {% generation %} among them)
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template: Jinja syntax error on line {e.lineno}: {e.message}") from None
    return template


@dataclass
class EngineConfig:
    model: str | None = _arg(None, "model folder (config.json + safetensors), a .gguf file, a config.json for dummy weights, or a Hugging Face Hub name (org/name: downloaded, or found in the cache offline); omit it for the embedded SmolLM2-135M-Instruct")
    tokenizer: str | None = _arg(None, "tokenizer folder, .gguf file or Hugging Face Hub name (default: the model's)")
    revision: str | None = _arg(None, "a Hugging Face Hub model's branch, tag or commit (default: main)")
    tokenizer_revision: str | None = _arg(None, "the same for a Hub tokenizer (default: main)")
    download_dir: str | None = _arg(None, "where Hub models are downloaded and looked up (default: the Hugging Face "
                                          "cache, ~/.cache/huggingface/hub; offline, HF_HUB_OFFLINE=1, only looked up)")
    trust_remote_code: bool = _arg(False, "accepted as vLLM's: nanoinfer never runs code from a model folder (its "
                                          "architectures are built in), so either value loads the same")
    chat_template: str | None = _arg(None, "chat template replacing the tokenizer's (for a model without one, or to change it): a Jinja file, or the template itself")
    load_format: str = _arg("auto", "how to load weights", ("auto", "safetensors", "gguf", "dummy"))
    dtype: str = _arg("auto", "weights and activations dtype (auto: float32 on CPU, the model's bf16/fp16 on GPU)", ("auto", "float32", "float16", "bfloat16", "half", "float"))
    device: str = _arg("auto", "where to run (auto: cuda if available)", ("auto", "cpu", "cuda"))
    seed: int | None = _arg(0, "seed for dummy weights and unseeded sampling (None: a random one)")
    block_size: int = _arg(16, "tokens per KV-cache block")
    max_model_len: int | None = _arg(None, "longest prompt + output (default: the model's max_position_embeddings)")
    max_num_batched_tokens: int | None = _arg(None, f"token budget of one step (prefill chunks + decodes); default {DEFAULT_MAX_NUM_BATCHED_TOKENS}, and for the offline LLM (generate, chat, benchmarks) {OFFLINE_LARGE_GPU_MAX_NUM_BATCHED_TOKENS} on a GPU of 70 GiB or more other than an A100, as in vLLM")
    max_num_seqs: int = _arg(256, "most requests in one step")
    kv_cache_dtype: str = _arg("auto", "KV cache element type (auto: the model's dtype; fp8 / fp8_e4m3: float8_e4m3fn, half the bytes of bf16, values stored unscaled, saturated at +-448)", ("auto", "fp8", "fp8_e4m3"))
    quantization: str | None = _arg(None, "weight quantization: fp8 stores every decoder projection's weight as float8_e4m3fn with a scale per output row (half the bytes of bf16; the embedding and LM head stay as they are); a checkpoint quantized to fp8 (its config.json's quantization_config) loads as fp8 without it (default: none)", ("fp8",))
    enable_prefix_caching: bool = _arg(True, "share KV blocks of equal prompt prefixes")
    enable_chunked_prefill: bool | None = _arg(True, "split long prompts across steps within the token budget: always on "
                                              "(the scheduler has one token budget for prefills and decodes)")
    kv_cache_memory_bytes: int | None = _arg(None, "KV cache size in bytes (default on CPU: 1 GiB; on GPU: sized by gpu_memory_utilization)")
    gpu_memory_utilization: float = _arg(0.9, "fraction of GPU memory for weights, activations and KV cache")
    num_kv_blocks: int | None = _arg(None, "exact number of KV blocks (overrides the byte budgets; for tests)")
    enforce_eager: bool = _arg(False, "on a GPU, run without CUDA graphs, the fused kernels (final RMSNorm, SiLU-and-mul; torch.compile) and the skinny matmul (cuBLAS everywhere): for checking")
    async_scheduling: bool = _arg(True, "plan the next step while the current one runs")
    attention_backend: str = _arg("auto", "attention implementation (auto: triton on GPU, torch on CPU)", ("auto", "torch", "triton"))
    scheduling_policy: str = _arg("fcfs", "order of waiting requests and choice of preemption victim", ("fcfs", "priority"))
    tensor_parallel_size: int = _arg(1, "number of tensor-parallel ranks")
    max_num_waiting: int | None = _arg(None, "bound on waiting requests; add_request fails when full (server: 503), "
                                             "generate() of more at once is refused (default: no bound)")
    generation_config: str = _arg("auto", "default sampling parameters of requests that leave them unset: auto takes temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens from the model folder's generation_config.json (as vLLM does); vllm ignores it; or a folder with a generation_config.json")
    runner: str = _arg("generate", "what the model does: generate text, or pool its hidden states into embeddings (LLM.embed, /v1/embeddings)", ("generate", "pooling"))
    max_logprobs: int = _arg(20, "most logprobs a request may ask for (logprobs, prompt_logprobs; beam search asks for 2 x its width), as vLLM's; -1: up to the vocabulary")
    speculative_config: dict | None = _arg(None, 'speculative decoding by n-gram lookup, vLLM\'s form: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M, "disable_by_batch_size": B}: each step checks up to K draft tokens copied from where the newest N..M tokens occurred before in the prompt or output; the output is unchanged, steps yield up to K + 1 tokens (turns async_scheduling off; default: off)')
    pooler_config: dict | None = _arg(None, 'with runner pooling: {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool} over what the model folder\'s sentence-transformers files say (default: LAST, normalized)')
    enable_lora: bool = _arg(False, "serve LoRA adapters: requests name one with a LoRARequest (the server's --lora-modules and a request's model name); their projections add the adapter's B A x")
    max_loras: int = _arg(1, "most LoRA adapters in one step (each a slot in every adapted layer; requests of other adapters wait)")
    max_lora_rank: int = _arg(16, "largest LoRA rank an adapter may have (every slot is this wide)")
    max_cpu_loras: int | None = _arg(None, "LoRA adapters kept loaded in host memory, so one evicted from its slot comes back without reading its files (default: max_loras)")
    reasoning_parser: str | None = _arg(None, "a thinking model's reasoning format: structured outputs then apply after the reasoning ends (</think>), and the server returns the reasoning as the chat message's reasoning_content. qwen3: reasoning when the reply opens with <think> (Qwen3); deepseek_r1: the chat template opens <think> in the prompt (DeepSeek-R1, QwQ, Qwen3 Thinking) (default: none; all is content and a grammar applies from the first token)", tuple(REASONING_PARSERS))

    def __post_init__(self) -> None:
        for name in ("model", "tokenizer", "generation_config", "download_dir"):  # a pathlib.Path is a path too
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                if not isinstance(value, os.PathLike):
                    raise TypeError(f"{name} must be a path (str or os.PathLike), got {type(value).__name__} {value!r}")
                setattr(self, name, os.fspath(value))
        if self.chat_template is not None:
            self.chat_template = read_chat_template(self.chat_template)
        if self.enable_chunked_prefill is None:  # vLLM's default: decided by the engine (here always on)
            self.enable_chunked_prefill = True
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "async_scheduling",
                     "trust_remote_code", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not self.enable_chunked_prefill:
            raise ValueError("enable_chunked_prefill=False is not supported: the scheduler gives prefill chunks and "
                             "decodes one token budget (max_num_batched_tokens), so long prompts are always split")
        for name in ("revision", "tokenizer_revision"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str (a branch, tag or commit), got {getattr(self, name)!r}")
        if self.seed is None:  # vLLM's reading: nondeterministic
            self.seed = random.SystemRandom().randrange(2**63)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if not isinstance(self.dtype, str):  # a torch.dtype, as vLLM takes it too
            self.dtype = str(self.dtype).removeprefix("torch.")
        self.dtype = {"half": "float16", "float": "float32"}.get(self.dtype, self.dtype)  # vLLM's aliases
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices and not (value is None and f.default is None):
                raise ValueError(f"{f.name}={value!r} is not one of {list(choices)}")
        if self.speculative_config is not None:
            from nanoinfer.spec_decode.ngram import SpeculativeConfig

            self.speculative = SpeculativeConfig.from_dict(self.speculative_config)
            if self.runner == "pooling":
                raise ValueError("speculative_config applies to runner='generate' only")
        else:
            self.speculative = None
        if self.enable_lora and self.runner == "pooling":
            raise ValueError("enable_lora applies to runner='generate' only")
        if self.pooler_config is not None:
            if not isinstance(self.pooler_config, dict):
                raise TypeError(f"pooler_config must be a dict, got {type(self.pooler_config).__name__}")
            if self.runner != "pooling":
                raise ValueError("pooler_config applies to runner='pooling' only")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
        positive = ["block_size", "max_num_batched_tokens", "max_num_seqs", "tensor_parallel_size", "max_loras",
                    "max_lora_rank"]
        positive += [n for n in ("max_model_len", "num_kv_blocks", "kv_cache_memory_bytes", "max_num_waiting",
                                 "max_cpu_loras") if getattr(self, n) is not None]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= -1 (-1: the vocabulary), got {self.max_logprobs!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.block_size > 1024:
            raise ValueError(f"block_size must be at most 1024 tokens, got {self.block_size}")
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0.0 < utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {utilization!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Like the constructor, but an unknown argument is an error that lists the valid ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; valid arguments: {sorted(names)}")
        return cls(**kwargs)


EngineArgs = EngineConfig  # vLLM's name: `LLMEngine.from_engine_args(EngineArgs(model=...))`
