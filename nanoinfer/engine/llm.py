"""The offline API: `LLM(...).generate(prompts, params)`, `chat`, `stream`."""

from __future__ import annotations

import itertools
import time
from typing import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from nanoinfer.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, OFFLINE_LARGE_GPU_MAX_NUM_BATCHED_TOKENS, EngineConfig
from nanoinfer.engine.llm_engine import LLMEngine
from nanoinfer.outputs import RequestOutput, RequestOutputKind
from nanoinfer.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


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
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop tensor-parallel workers now (otherwise done at garbage collection or exit)."""
        self.engine.core.close()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (vLLM's name), so that the same prompts prefill again, as a
        benchmark's repeat needs. Possible only while no request holds blocks: returns whether it was done."""
        return self.engine.core.scheduler.kv_cache_manager.reset_prefix_cache()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        ids = [str(next(self._ids)) for _ in prompts]
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(request_id, prompt, p, output_kind=RequestOutputKind.FINAL_ONLY)
        except Exception:
            for request_id in ids:  # all or nothing: take back what was added
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, num_output_tokens = time.perf_counter(), 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    num_output_tokens += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
                    bar.set_postfix_str(f"output {num_output_tokens / (time.perf_counter() - start):.0f} tok/s")
        bar.close()
        return [results[i] for i in ids]

    def chat(self, messages: list[Message] | list[list[Message]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                       tokenize=True, return_dict=False))

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Generate for one prompt, yielding text as it is produced (stop strings never leak)."""
        request_id = str(next(self._ids))
        self.engine.add_request(request_id, prompt, sampling_params, output_kind=RequestOutputKind.DELTA)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id == request_id:
                        if out.outputs[0].text:
                            yield out.outputs[0].text
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(request_id)
