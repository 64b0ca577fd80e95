"""Greedy outputs of two code paths compared the way rounding allows.

Two correct implementations that sum in another order (fused kernels, split GEMMs,
an all-reduce) can flip a near-tie, and the sequences then diverge. So outputs
must agree token for token until the first difference, and there the reference
must have ranked the other path's token within `tol` of its own (a tie); a wrong
kernel diverges where the reference is sure."""

from __future__ import annotations

import gc
import os
import random

import torch

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "nanoinfer", "configs")
TOP_LOGPROBS = 5


def prompts(n: int = 32) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randint(0, 10000) for _ in range(rng.randint(5, 300))] for _ in range(n)]


def greedy(model: str, lora_request=None, **engine_args) -> list:
    """The CompletionOutputs of 64 greedy tokens for each of 32 prompts, with top-5 logprobs (`lora_request`: as
    `LLM.generate` takes it)."""
    from nanoinfer import LLM

    # 4096 tokens per step (the 32 prompts prefill in two steps): the offline default (16,384 on a large GPU)
    # makes the fp32 reference path's profiled peak (~41 GiB) exceed 0.4 of an 80 GB H100.
    engine_args = {"max_model_len": 2048, "gpu_memory_utilization": 0.4, "max_num_batched_tokens": 4096, **engine_args}
    llm = LLM(model, **engine_args)
    try:
        return [o.outputs[0] for o in llm.generate(prompts(), greedy_params(), use_tqdm=False,
                                                   lora_request=lora_request)]
    finally:
        llm.close()
        del llm
        free_gpu_memory()


def greedy_params():
    from nanoinfer import SamplingParams

    return SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=TOP_LOGPROBS)


def free_gpu_memory() -> None:
    """After the caller dropped its last reference to an engine: engines hold reference cycles, so collect
    them and give their memory back, before the next engine sizes its KV cache from what is free."""
    gc.collect()
    torch.cuda.empty_cache()


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two sequences differ; None if one is a prefix of the other."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def assert_greedy_close(reference: list, tested: list, tol: float = 1e-3, max_diverged: float = 0.25) -> None:
    """Token-for-token equality up to near-ties of the reference (see the module docstring); at
    most `max_diverged` of the sequences may diverge at such ties."""
    diverged = 0
    for i, (ref, out) in enumerate(zip(reference, tested)):
        pos = first_difference(ref.token_ids, out.token_ids)
        if pos is not None:
            a, b, top = ref.token_ids[pos], out.token_ids[pos], ref.logprobs[pos]
            assert b in top and top[a].logprob - top[b].logprob <= tol, (
                f"prompt {i}, token {pos}: {b} instead of {a}; the reference's top logprobs {top}")
            diverged += 1
    print(f"{diverged} of {len(reference)} sequences diverged at near-ties")
    assert diverged <= max_diverged * len(reference), f"{diverged} of {len(reference)} sequences diverged"


def common_prefix(a: list, b: list) -> float:
    """Mean number of leading tokens two lists of outputs agree on."""
    total = 0
    for x, y in zip(a, b):
        pos = first_difference(x.token_ids, y.token_ids)
        total += len(x.token_ids) if pos is None else pos
    return total / len(a)
