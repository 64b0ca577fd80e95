"""Tensor parallelism on two GPUs (NCCL): TP=2 greedy output equals TP=1 for the
Qwen3-0.6B and Qwen3-8B shapes with dummy weights (the same full model for every
TP size), in float32, up to near-ties that another summation order may flip (see
greedy_compare). Run on a machine with two GPUs:
`python -m pytest -m gpu tests/gpu/test_tp_gpu.py`."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from greedy_compare import CONFIGS, assert_greedy_close, free_gpu_memory, greedy, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.mark.parametrize("config,tp2_args", [
    ("qwen3-0.6b.json", {"enforce_eager": False}),  # CUDA graphs with all-reduces inside
    ("qwen3-0.6b.json", {"enforce_eager": True}),
    ("qwen3-0.6b.json", {"enforce_eager": True, "async_scheduling": False}),
    ("qwen3-8b.json", {"enforce_eager": True}),  # eager: capturing the 8B shape's graphs takes long
], ids=["qwen3-0.6b-graphs", "qwen3-0.6b-eager", "qwen3-0.6b-eager-sync", "qwen3-8b-eager"])
def test_tp2_equals_tp1(config: str, tp2_args: dict) -> None:
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"  # inherited by every rank before NCCL starts
    assert_greedy_close(tp1_outputs(config), greedy(os.path.join(CONFIGS, config), tensor_parallel_size=2,
                                                   **COMMON, **tp2_args))


COMMON = {"load_format": "dummy", "dtype": "float32", "gpu_memory_utilization": 0.6}


@functools.cache
def tp1_outputs(config: str) -> list:
    return greedy(os.path.join(CONFIGS, config), enforce_eager=True, **COMMON)


def test_tp2_prompt_logprobs_equal_tp1() -> None:
    """prompt_logprobs gather the vocab-parallel LM head's rows of every prompt position (eager, beside the
    graphs' replays): TP=2 gives TP=1's values."""
    from nanoinfer import LLM, SamplingParams

    def score(**engine_args) -> list[torch.Tensor]:
        llm = LLM(os.path.join(CONFIGS, "qwen3-0.6b.json"), max_num_batched_tokens=256, **COMMON, **engine_args)
        try:
            outs = llm.generate(prompts()[:8], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1),
                                use_tqdm=False)
            return [torch.tensor([lp[t].logprob for t, lp in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])])
                    for o in outs]
        finally:
            llm.close()
            del llm
            free_gpu_memory()

    for ours, ref in zip(score(tensor_parallel_size=2), score()):
        assert torch.allclose(ours, ref, atol=1e-3)


def test_tp2_embeddings_equal_tp1() -> None:
    """runner="pooling" under TP=2 on GPUs: rank 0 pools the hidden states (the same on every rank after the
    last all-reduce), through decode graphs (one-token prompts) and eager chunks; TP=1's vectors."""
    from nanoinfer import LLM

    def embed(**engine_args) -> torch.Tensor:
        llm = LLM(os.path.join(CONFIGS, "qwen3-0.6b.json"), runner="pooling", max_num_batched_tokens=256,
                  pooler_config={"pooling_type": "MEAN"}, **COMMON, **engine_args)
        try:
            return torch.tensor([o.outputs.embedding for o in llm.embed(prompts()[:8] + [[7]], use_tqdm=False)])
        finally:
            llm.close()
            del llm
            free_gpu_memory()

    assert torch.allclose(embed(tensor_parallel_size=2), embed(), atol=1e-4)


def _fused_all_reduce_rank(rank: int, port: int, errors) -> None:
    """One rank of test_fused_all_reduce_matches_nccl."""
    import torch.distributed as dist

    from nanoinfer.distributed import parallel_state as ps

    try:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=ps.COLLECTIVE_TIMEOUT)
        ps.init_tensor_parallel(rank, 2, rank, store)
        hidden, max_rows, dtype = 4096, 256, torch.bfloat16
        assert ps.enable_symmetric_all_reduce(max_rows, hidden, dtype)
        kernel = ps.fused_all_reduce()

        def inputs(call: int, rows: int) -> tuple[list[torch.Tensor], torch.Tensor]:
            g = torch.Generator(device="cuda").manual_seed(call)
            parts = [torch.randn(rows, hidden, device="cuda", generator=g).to(dtype) for _ in range(2)]
            return parts, torch.randn(rows, hidden, device="cuda", generator=g).to(dtype)

        def check(call: int, rows: int, out: torch.Tensor, with_residual: bool = True) -> None:
            parts, residual = inputs(call, rows)
            want = (parts[0].float() + parts[1].float()).to(dtype)
            if with_residual:
                want = want + residual
            assert torch.equal(out, want), f"call {call}: the sum differs"

        # Eager: many calls back to back, consecutive slots different, sizes changing (200 rows: two
        # per program), some without a residual (the embedding's), as a decode loop does.
        for call in range(200):
            rows = (1, 3, 16, 200)[call % 4]
            parts, residual = inputs(call, rows)
            with_residual = call % 5 != 0
            out = kernel(parts[rank], residual if with_residual else None, call % 3)
            check(call, rows, out, with_residual)
        print(f"rank {rank}: 200 eager calls checked", flush=True)  # where a hang stopped (pytest -s)
        # In a CUDA graph (the decode path): capture 63 calls, replay it several times.
        parts, residual = inputs(1000, 8)
        static = [kernel(parts[rank], residual, 2)]  # the slot before the graph's first
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in range(63):  # ends on slot 2: the next replay starts on 0
                static.append(kernel(parts[rank], residual, call % 3))
        print(f"rank {rank}: graph captured", flush=True)
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        print(f"rank {rank}: 20 replays done", flush=True)
        for out in static:
            check(1000, 8, out)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        ps.destroy_tensor_parallel()


def test_fused_all_reduce_matches_nccl() -> None:
    """The fused all-reduce + add + RMSNorm kernel on two GPUs: bit-identical sums and residuals to
    the PyTorch path's (so both ranks keep the same residual stream) over 200 eager calls and 20
    replays of a 63-call CUDA graph, slots rotating; a race on a buffer would show as a mismatch."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    errors = context.Queue()
    port = 29600 + os.getpid() % 1000
    procs = [context.Process(target=_fused_all_reduce_rank, args=(rank, port, errors)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung (a lost flag in the kernel's barrier?)"
    assert errors.empty(), errors.get()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
