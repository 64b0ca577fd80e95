"""The in-process engine: front end (tokenize, validate, detokenize) around
an `EngineCore`. `add_request` / `step` / `abort_request` is the interface the
`LLM` API and the server build on."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterable

from nanoinfer.config import EngineConfig
from nanoinfer.engine.core import EngineCore
from nanoinfer.engine.input_processor import InputProcessor
from nanoinfer.inputs import PromptType
from nanoinfer.engine.output_processor import OutputProcessor
from nanoinfer.loader.resolve import ModelSource, resolve_model
from nanoinfer.lora.adapter import admission_registry
from nanoinfer.lora.request import LoRARequest
from nanoinfer.outputs import EmbeddingRequestOutput, RequestOutput
from nanoinfer.pooling_params import PoolingParams
from nanoinfer.request import RequestStatus
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams


def load_tokenizer(path: str | None):
    """A transformers tokenizer from a local folder, or None (token-id prompts only)."""
    if path is None:
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises many types for a bad folder
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e


def checked_tokenizer(tokenizer):
    """`tokenizer`, or the error of a get_tokenizer() (vLLM's) where the model has none."""
    if tokenizer is None:
        raise ValueError("this engine has no tokenizer: its model folder holds none (give tokenizer=PATH)")
    return tokenizer


def load_model_and_tokenizer(config: EngineConfig) -> tuple[ModelSource, object]:
    """Resolve the model (a GGUF is converted once, before any other process reads the cache)
    and load its tokenizer; the tokenizer's eos id joins the config's end-of-sequence ids."""
    source = resolve_model(config)
    tokenizer = load_tokenizer(source.tokenizer_path)
    if config.chat_template is not None:
        if tokenizer is None:
            raise ValueError("chat_template needs a tokenizer: this model has none (give tokenizer=PATH)")
        tokenizer.chat_template = config.chat_template
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        source = dataclasses.replace(source, eos_token_ids=source.eos_token_ids | {tokenizer.eos_token_id})
    return source, tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        source, self.tokenizer = load_model_and_tokenizer(config)
        self.core = EngineCore(config, source)
        self.limits = self.core.limits()
        self.pooler = source.pooler
        self.input_processor = InputProcessor(self.tokenizer, self.limits, self.core.runner.grammar_compiler,
                                              self.pooler, source.hf_config.hidden_size,
                                              admission_registry(config, source.hf_config))
        self.output_processor = OutputProcessor(self.tokenizer, self.pooler)
        self.default_sampling = source.default_sampling
        self._admissions = itertools.count()

    @classmethod
    def from_engine_args(cls, engine_args: EngineConfig) -> LLMEngine:
        """vLLM's way to build an engine: `LLMEngine.from_engine_args(EngineArgs(model=...))`."""
        return cls(engine_args)

    def get_tokenizer(self):
        """The engine's tokenizer (a transformers tokenizer), as vLLM's: for chat templates, counting tokens or
        decoding token ids."""
        return checked_tokenizer(self.tokenizer)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's recommended values (EngineConfig.generation_config) in place."""
        return SamplingParams(**self.default_sampling)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams | None = None, *,
                    priority: int = 0, cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> str:
        """Admit a request under the caller's `request_id` (returned); its outputs are as `params.output_kind`
        says. `priority`, `cache_salt` and `lora_request` (its adapter) are keywords (vLLM's fourth argument is
        another). In the core it gets an
        id of its own (the caller's plus an admission number), so that an id used again after an abort never
        receives tokens that the earlier request's step, still in flight, sampled."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(params, (SamplingParams, PoolingParams)):
            params = dataclasses.replace(params)  # validated again (a field may have been set after construction)
        params = params or (PoolingParams() if self.pooler else self.default_sampling_params())
        admitted = self.input_processor.process(f"{request_id}@{next(self._admissions)}", prompt, params, priority,
                                                cache_salt, lora_request)
        self.limits.check_waiting_room(len(self.core.scheduler.waiting), len(admitted.children))
        output_kind = params.output_kind if isinstance(params, SamplingParams) else RequestOutputKind.FINAL_ONLY
        self.output_processor.add_request(request_id, admitted.prompt, admitted.prompt_token_ids, params,
                                          [c.request_id for c in admitted.children], output_kind)
        for child in admitted.children:
            self.core.add_request(child)
        return request_id

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort one request or several (vLLM takes a list); returns the final outputs of those still unfinished."""
        request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        finals = []
        for request_id in request_ids:
            self.core.abort_requests(self.output_processor.child_ids(request_id))
            final = self.output_processor.abort(request_id)
            if final is not None:
                finals.append(final)
        return finals

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """Run one engine step; return the outputs of the requests that got new tokens, each
        as its output kind asks (FINAL_ONLY requests only when they finish)."""
        outputs, stopped = self.output_processor.process_outputs(self.core.step())
        if stopped:
            self.core.abort_requests(list(stopped), RequestStatus.FINISHED_STOPPED)
        return outputs
