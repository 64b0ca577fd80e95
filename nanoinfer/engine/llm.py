"""The offline API: `LLM(...).generate(prompts, params)`, `chat`, `stream`; `beam_search`; `embed` and `score`
with runner="pooling"."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import time
from collections.abc import Iterable, Mapping
from typing import Any, Iterator, Sequence

import torch
from tqdm.auto import tqdm

from nanoinfer.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, OFFLINE_LARGE_GPU_MAX_NUM_BATCHED_TOKENS, EngineConfig
from nanoinfer.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, advance_all, live_beams
from nanoinfer.engine.core import defer_full_collections
from nanoinfer.engine.input_processor import unpack_prompt
from nanoinfer.engine.llm_engine import LLMEngine
from nanoinfer.inputs import PromptType
from nanoinfer.lora.request import LoRARequest
from nanoinfer.outputs import (EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput, ScoringOutput,
                               ScoringRequestOutput)
from nanoinfer.pooling_params import PoolingParams, cosine, score_pairs
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams

Message = dict[str, Any]
_collecting = False  # a garbage collection is running: finalizers run, wherever the code that allocated was


def _track_collections(phase: str, info: dict) -> None:
    global _collecting
    _collecting = phase == "start"


gc.callbacks.append(_track_collections)


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (text, token ids or a dict) or several, as a list of prompts."""
    if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _check_messages(messages: object) -> None:
    """A conversation as chat templates expect it: a non-empty list of {"role": str, "content": str or a list of
    OpenAI's text parts} (an assistant's message may instead hold 'tool_calls' and no content)."""
    if not isinstance(messages, list) or not messages:
        raise TypeError(f"a conversation must be a non-empty list of messages ({{'role': ..., 'content': ...}}), "
                        f"got {type(messages).__name__} {messages!r:.80}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"message {i} must be a dict with 'role' and 'content', got {type(message).__name__}")
        content = message.get("content")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"message {i} needs a string 'role', got {message.get('role')!r:.80}")
        if not (isinstance(content, (str, list)) or (content is None and message.get("tool_calls"))):
            raise ValueError(f"message {i} needs a 'content': a string or a list of text parts ({{'type': 'text', "
                             f"'text': ...}}), or None beside 'tool_calls'; got {content!r:.80}")


def offline_max_num_batched_tokens(device: str = "auto") -> int:
    """vLLM's token budget for its offline LLM class: 16384 on a GPU of 70 GiB or more other than an
    A100, else 8192 (the server keeps 8192: each step's length is a latency there). Offline, fewer and
    larger prefill chunks cost less per-step launch overhead: on an H200 the reference workload's 18
    mixed steps become 9, 0.46-0.53 -> 0.40-0.42 s with an fp8 KV cache (bench/RESULTS.md)."""
    if device == "cpu" or not torch.cuda.is_available():
        return DEFAULT_MAX_NUM_BATCHED_TOKENS
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower():
        return OFFLINE_LARGE_GPU_MAX_NUM_BATCHED_TOKENS
    return DEFAULT_MAX_NUM_BATCHED_TOKENS


class LLM:
    """An engine for offline generation. `model=None` loads the embedded SmolLM2-135M-Instruct;
    every other keyword is an engine argument (see `EngineConfig`); unknown ones are errors.
    Unset, `max_num_batched_tokens` is `offline_max_num_batched_tokens()`."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        if engine_args.get("max_num_batched_tokens") is None:
            engine_args["max_num_batched_tokens"] = offline_max_num_batched_tokens(engine_args.get("device", "auto"))
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args))
        self.tokenizer = self.llm_engine.tokenizer
        self._ids = itertools.count()
        # Outputs per request of this LLM's unfinished calls: a step runs every request in the engine, so a call
        # (a generate, or an open stream) finds its outputs here wherever they were stepped.
        self._inbox: dict[str, list[RequestOutput]] = {}
        self._ready: set[str] = set()  # the requests whose inbox entry holds outputs
        self._abandoned: list[str] = []  # streams the collector finalized: aborted before the next step

    def close(self) -> None:
        """Stop tensor-parallel workers now (otherwise done at garbage collection or exit)."""
        self.llm_engine.core.close()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (vLLM's name), so that the same prompts prefill again, as a
        benchmark's repeat needs. Possible only while no request holds blocks: returns whether it was done."""
        self._forget_abandoned()
        return self.llm_engine.core.scheduler.kv_cache_manager.reset_prefix_cache()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
                 priority: Sequence[int] | None = None, *,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. Without `sampling_params`, the model's
        defaults (`get_default_sampling_params`); `priority`: one per prompt (lower runs first), under
        scheduling_policy="priority" only: otherwise a non-zero priority is a ValueError (as vLLM's);
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base model; enable_lora)."""
        return self._submit(prompts, self.get_default_sampling_params() if sampling_params is None else sampling_params,
                            use_tqdm, priority, lora_request)

    def get_tokenizer(self):
        """The engine's tokenizer (a transformers tokenizer), as vLLM's: for chat templates, counting tokens or
        decoding token ids."""
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams() with the values of the model's generation_config.json (temperature, top_p,
        top_k, min_p, repetition_penalty, max_new_tokens as max_tokens), unless generation_config='vllm'."""
        return self.llm_engine.default_sampling_params()

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True, priority: Sequence[int] | None = None, *,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (`outputs.embedding`), in prompt order; the engine must be built with
        runner="pooling". `truncate_prompt_tokens` (vLLM's keyword) sets that field of every pooling_params."""
        params = PoolingParams() if pooling_params is None else pooling_params
        if truncate_prompt_tokens is not None:
            params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens) \
                if isinstance(params, PoolingParams) else \
                [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        return self._submit(prompts, params, use_tqdm, priority)

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True, priority: Sequence[int] | None = None, *,
               truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """vLLM's pooling call: `embed`'s vectors as tensors (`outputs.data`)."""
        outputs = self.embed(prompts, pooling_params, use_tqdm, priority, truncate_prompt_tokens=truncate_prompt_tokens)
        return [PoolingRequestOutput.of(o) for o in outputs]

    def score(self, data_1: PromptType | Sequence[PromptType], data_2: PromptType | Sequence[PromptType],
              use_tqdm: bool = True, pooling_params: PoolingParams | None = None, *,
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """vLLM's scoring with an embedding model (runner="pooling"): the cosine similarity of each pair's
        embeddings, pairing one `data_1` text with each of `data_2`'s, or the two lists element by element;
        `pooling_params` applies to every text (truncate_prompt_tokens, a Matryoshka model's dimensions). Each
        output's `prompt_token_ids` are its pair's two prompts, one after the other."""
        side_1, side_2 = _prompt_list(data_1), _prompt_list(data_2)
        pairs = score_pairs(len(side_1), len(side_2))  # they pair up (ValueError otherwise) before anything runs
        outputs = self.embed(side_1 + side_2, pooling_params, use_tqdm=use_tqdm,
                             truncate_prompt_tokens=truncate_prompt_tokens)
        first, second = outputs[: len(side_1)], outputs[len(side_1):]
        return [ScoringRequestOutput(str(k), ScoringOutput(cosine(first[i].outputs.embedding,
                                                                  second[j].outputs.embedding)),
                                     first[i].prompt_token_ids + second[j].prompt_token_ids)
                for k, (i, j) in enumerate(pairs)]

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False, *, lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search: for each prompt, the `params.beam_width` best sequences (prompt included), best
        first. Each step runs every live beam as a one-token request (nanoinfer/engine/beam_search.py), with the
        LoRA adapter `lora_request` if given."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        engine = self.llm_engine
        params.check_width(engine.limits.max_logprobs)
        unpacked = [unpack_prompt(p) for p in _prompt_list(prompts)]
        prompts = [engine.input_processor.tokenize(prompt) for prompt, _, _ in unpacked]
        for ids in prompts:  # the longest beams' last step must fit too: checked before any step runs
            engine.input_processor.check_length(len(ids), params.max_tokens)
        engine.limits.check_waiting_room(0, params.beam_width * len(prompts))  # each step's beams, as the server
        searches = [BeamSearch(ids, params, engine.limits.eos_token_ids, salt)
                    for ids, (_, _, salt) in zip(prompts, unpacked)]
        bar = tqdm(total=params.max_tokens, desc="Beam search", unit="step", disable=not use_tqdm, dynamic_ncols=True)
        while beams := live_beams(searches):
            advance_all(beams, self.generate([{"prompt_token_ids": beam.tokens, "cache_salt": search.cache_salt}
                                              for search, beam in beams],
                                             params.step_params(), use_tqdm=False, lora_request=lora_request))
            bar.update(1)
        bar.close()
        results = []
        for search in searches:
            best = search.best()
            for beam in best:
                beam.text = None if self.tokenizer is None else self.tokenizer.decode(beam.tokens)
            results.append(BeamSearchOutput(best))
        return results

    def _submit(self, prompts: PromptType | Sequence[PromptType], params: Any, use_tqdm: bool,
                priority: Sequence[int] | None = None, lora_request: Any = None) -> list:
        """Add every prompt with its params, priority and LoRA adapter (each: one for all, or one per prompt), and
        run them to the end, all or none."""
        prompts = _prompt_list(prompts)
        params = [params] * len(prompts) if isinstance(params, (SamplingParams, PoolingParams)) else list(params)
        priority = [0] * len(prompts) if priority is None else list(priority)
        loras = [lora_request] * len(prompts) if lora_request is None or isinstance(lora_request, LoRARequest) \
            else list(lora_request)
        if not len(params) == len(priority) == len(loras) == len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} params, {len(priority)} priorities and "
                             f"{len(loras)} LoRA requests")
        # All are added before any runs: a call that max_num_waiting could never queue is refused as a whole.
        self.llm_engine.limits.check_waiting_room(0, sum(p.n if isinstance(p, SamplingParams) else 1 for p in params))
        ids = [str(next(self._ids)) for _ in prompts]
        with defer_full_collections():
            try:
                for request_id, prompt, p, rank, lora in zip(ids, prompts, params, priority, loras):
                    self._inbox[request_id] = []
                    if isinstance(p, SamplingParams):
                        p = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                    self.llm_engine.add_request(request_id, prompt, p, priority=rank, lora_request=lora)
                return self._run(ids, use_tqdm)
            finally:  # all or nothing: after an error (or Ctrl-C) the requests added are taken back
                self._forget(ids)

    def _run(self, ids: list[str], use_tqdm: bool) -> list:
        results: dict[str, RequestOutput | EmbeddingRequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processing", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, num_tokens = time.perf_counter(), 0
        for out in self._outputs(ids):
            results[out.request_id] = out
            embedding = isinstance(out, EmbeddingRequestOutput)  # counted by its prompt, the work it took
            num_tokens += len(out.prompt_token_ids) if embedding else sum(len(c.token_ids) for c in out.outputs)
            bar.update(1)
            bar.set_postfix_str(f"{'input' if embedding else 'output'} "
                                f"{num_tokens / (time.perf_counter() - start):.0f} tok/s")
        bar.close()
        return [results[i] for i in ids]

    def _outputs(self, ids: Iterable[str]) -> Iterator[RequestOutput | EmbeddingRequestOutput]:
        """The outputs of requests `ids` (each with its inbox entry) as they come, until all have finished.
        Per step it touches only the requests that got outputs (not every one of `ids`)."""
        unfinished = set(ids)
        while unfinished:
            ready = self._ready & unfinished
            if not ready:
                self._forget_abandoned()
                if not self.llm_engine.has_unfinished_requests():
                    raise RuntimeError(f"requests {sorted(unfinished)} were aborted outside this call")
                for out in self.llm_engine.step():
                    box = self._inbox.get(out.request_id)  # None: a request of the engine's own user
                    if box is not None:
                        box.append(out)
                        self._ready.add(out.request_id)
                continue
            for request_id in ready:
                self._ready.discard(request_id)
                outs, self._inbox[request_id] = self._inbox[request_id], []
                for out in outs:
                    if out.finished:
                        unfinished.discard(request_id)
                    yield out

    def _forget(self, ids: Iterable[str]) -> None:
        """Abort what is unfinished of `ids` (their blocks go back) and drop their inbox entries."""
        for request_id in ids:
            self.llm_engine.abort_request(request_id)
            self._inbox.pop(request_id, None)
            self._ready.discard(request_id)

    def _forget_abandoned(self) -> None:
        """Abort the streams the garbage collector finalized. A collection can start inside a step (at any
        allocation), and an abort there would change the step's requests under it, so it waits until here."""
        while self._abandoned:
            self._forget([self._abandoned.pop()])

    def chat(self, messages: list[Message] | list[list[Message]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, continue_final_message: bool = False,
             chat_template: str | None = None, *, lora_request: LoRARequest | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the model's chat template (or
        `chat_template`, a Jinja template's text); `tools`: the functions the template offers the model (OpenAI's
        {"type": "function", "function": {...}} form); `chat_template_kwargs`: more template variables (e.g.
        Qwen3's {"enable_thinking": False}); `continue_final_message`: the reply continues the last (assistant's)
        message instead of starting anew; `lora_request`: the LoRA adapter that replies. Each output's `prompt` is
        the rendered conversation."""
        if isinstance(messages, list) and messages and isinstance(messages[0], Mapping):
            messages = [messages]
        if not isinstance(messages, list):
            raise TypeError(f"chat() takes a conversation (a list of {{'role': ..., 'content': ...}}) or a list of "
                            f"them, got {type(messages).__name__}; for plain text use generate()")
        prompts = [self._render_chat(c, add_generation_prompt, tools, chat_template_kwargs, continue_final_message,
                                     chat_template) for c in messages]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                            continue_final_message: bool = False, chat_template: str | None = None) -> list[int]:
        """The conversation's token ids, as `chat` would prompt the model with them."""
        return self._render_chat(messages, add_generation_prompt, tools, chat_template_kwargs, continue_final_message,
                                 chat_template)["prompt_token_ids"]

    def _render_chat(self, messages: list[Message], add_generation_prompt: bool, tools: list[dict] | None,
                     chat_template_kwargs: dict | None, continue_final_message: bool, chat_template: str | None
                     ) -> dict:
        _check_messages(messages)
        return self.llm_engine.input_processor.render_chat(messages, add_generation_prompt, continue_final_message,
                                                       tools, chat_template_kwargs, chat_template)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None, *,
               lora_request: LoRARequest | None = None) -> Iterator[str]:
        """Generate for one prompt (with the LoRA adapter `lora_request` if given), yielding text as it is produced
        (stop strings never leak). Streams may be read interleaved with each other and with `generate`: each gets
        its own request's text."""
        if isinstance(sampling_params, SamplingParams) and sampling_params.n != 1:
            raise ValueError(f"stream() yields one completion's text, so n must be 1 (got {sampling_params.n}); "
                             f"generate() returns n completions")
        if isinstance(sampling_params, PoolingParams):
            raise ValueError("stream() yields generated text; embeddings come from embed()")
        if isinstance(sampling_params, SamplingParams) and not sampling_params.detokenize:
            raise ValueError("stream() yields text, which detokenize=False leaves out; generate() returns the token "
                             "ids")
        if self.tokenizer is None and self.llm_engine.config.runner != "pooling":  # (pooling: refused below)
            raise ValueError("stream() yields text, which needs a tokenizer: this model has none (give "
                             "tokenizer=PATH); generate() returns the token ids")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()  # a pooling engine refuses it: no text to stream
        return self._stream(str(next(self._ids)), prompt, sampling_params, lora_request)

    def _stream(self, request_id: str, prompt: PromptType, sampling_params: SamplingParams | None,
                lora_request: LoRARequest | None) -> Iterator[str]:
        self._inbox[request_id] = []
        try:
            if isinstance(sampling_params, SamplingParams):
                sampling_params = dataclasses.replace(sampling_params, output_kind=RequestOutputKind.DELTA)
            self.llm_engine.add_request(request_id, prompt, sampling_params, lora_request=lora_request)
            for out in self._outputs([request_id]):
                if out.outputs[0].text:
                    yield out.outputs[0].text
        finally:
            if _collecting:  # closed by the collector, perhaps in the middle of a step: aborted between steps
                self._abandoned.append(request_id)
            else:
                self._forget([request_id])
