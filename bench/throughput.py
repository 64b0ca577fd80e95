"""Offline throughput on the reference workload (../shared/README.md), exactly:
256 sequences, seed 0, prompts of 100-1024 random token ids, temperature 0.6,
ignore_eos, max_tokens 100-1024; Qwen3-0.6B shape with dummy weights.

    python bench/throughput.py [--peer hf] [--repeat N] [--loras N] [engine flags]

The figure is the first timed run's, on a fresh cache (its free queue hands out
blocks in order). --repeat N times the workload N - 1 more times in the same
engine, the prefix cache reset in between: those runs see a used cache, whose
blocks come back in the order requests freed them, as in a server that has run
a while, and they cost seconds where a new process costs half a minute.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from random import randint, seed

from common import GcPauses, engine_kwargs, parser, report


def workload(num_seqs: int, sampling: dict | None = None):
    """The reference workload; `sampling`: more SamplingParams fields for every request (--sampling: a variant,
    e.g. with penalties or a grammar, to measure what those cost; not the reference figure)."""
    from nanoinfer import SamplingParams

    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, 1024), **(sampling or {}))
              for _ in range(num_seqs)]
    return prompts, params


def warm_up(engine, loras: list | None = None) -> None:
    """A short batch shaped like the workload (other token ids, so nothing of it is prefix-cached),
    so one-time kernel compilation for mixed prefill steps, and the loading of --loras adapters, stay out of the
    timing."""
    from nanoinfer import SamplingParams

    seed(1)
    for i in range(32):
        prompt = [randint(10001, 20000) for _ in range(randint(100, 1024))]
        engine.add_request(f"warm-up {i}", prompt, SamplingParams(max_tokens=8, ignore_eos=True),
                           **_lora_kwarg(None if loras is None else loras[i % len(loras)]))
    while engine.has_unfinished_requests():
        engine.step()


def lora_requests(args, folder: str) -> list | None:
    """--loras N: N random adapters of rank max_lora_rank on every projection (the LoRA tests' `make_adapter`),
    request i taking adapter i % N; the engine gets enable_lora and max_loras >= N. None without --loras."""
    if not args.loras:
        return None
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from test_lora import make_adapter

    from nanoinfer import LoRARequest

    args.enable_lora, args.max_loras = True, max(args.max_loras, args.loras)
    adapters = [LoRARequest(f"bench-{i}", i + 1, make_adapter(os.path.join(folder, str(i)), args.model, seed=i,
                                                              rank=args.max_lora_rank, alpha=args.max_lora_rank))
                for i in range(args.loras)]
    return [adapters[i % args.loras] for i in range(args.num_seqs)]


def _lora_kwarg(lora) -> dict:
    """lora_request=... only when given, so the script still runs builds older than LoRA (bench/ab.sh)."""
    return {} if lora is None else {"lora_request": lora}


def run_nanoinfer(args) -> dict:
    from nanoinfer import LLM

    folder = tempfile.mkdtemp(prefix="bench-loras-")
    loras = lora_requests(args, folder)
    llm = LLM(**engine_kwargs(args))
    prompts, params = workload(args.num_seqs, args.sampling)
    warm_up(llm.llm_engine, loras)
    runs = []
    for i in range(args.repeat):
        if i and not llm.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset: a request still holds blocks")
        runs.append(timed_run(llm, prompts, params, args, loras))
    shutil.rmtree(folder)
    core = llm.llm_engine.core
    figures = {"engine": "nanoinfer", "num_seqs": args.num_seqs, **runs[0], "kv_blocks": core.num_blocks,
               "preemptions": core.scheduler.num_preemptions}
    if len(runs) > 1:
        figures["repeats_on_used_cache"] = runs[1:]
    print(f"nanoinfer: {figures}", flush=True)  # before shutdown, which could outlive the time limit
    llm.close()
    return figures


def timed_run(llm, prompts, params, args, loras: list | None = None) -> dict:
    steps = _time_steps(llm.llm_engine.core) if args.step_stats else None
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm, **_lora_kwarg(loras))
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"output_tokens": tokens, "seconds": round(elapsed, 3), "output_tok_per_s": round(tokens / elapsed, 1),
            **({"steps": _summarise(steps, llm.llm_engine.core)} if steps is not None else {})}


def _time_steps(core) -> dict:
    """Wrap the core's step to record (decode-only?, requests, seconds, seconds waiting for the
    device) per step, and watch what could stall a step from outside it: Python's garbage collector
    (pause per collection) and torch.compile (graphs compiled during the run). A step that waits
    ~0 for the previous step's tokens is paced by the host, not the GPU."""
    import torch
    from torch._dynamo.utils import counters

    stats = {"records": [], "gc": GcPauses().start(), "graphs_before": counters["stats"]["unique_graphs"]}
    records, schedule, step = stats["records"], core.scheduler.schedule, core.step
    synchronize = torch.cuda.Event.synchronize
    stats["unwrapped"] = schedule, step, synchronize

    def timed_schedule():
        out = schedule()
        records.append([all(n == 1 for n in out.num_scheduled_tokens.values()), len(out.num_scheduled_tokens), 0.0, 0.0])
        return out

    def timed_synchronize(event):
        t = time.perf_counter()
        synchronize(event)
        if records:
            records[-1][3] += time.perf_counter() - t

    def timed_step():
        t = time.perf_counter()
        result = step()
        records[-1][2] = time.perf_counter() - t
        return result

    core.scheduler.schedule, core.step = timed_schedule, timed_step
    torch.cuda.Event.synchronize = timed_synchronize
    return stats


def _summarise(stats, core) -> dict:
    import torch
    from torch._dynamo.utils import counters

    stats["gc"].stop()
    pauses = stats["gc"].pauses
    core.scheduler.schedule, core.step, torch.cuda.Event.synchronize = stats["unwrapped"]
    records = stats["records"]
    decode = [r for r in records if r[0] and r[1]]
    mixed = [r for r in records if not r[0]]
    by_batch = {}
    for lo, hi in ((1, 16), (17, 64), (65, 192), (193, 256)):
        sel = [r[2] for r in decode if lo <= r[1] <= hi]
        waits = [r[3] for r in decode if lo <= r[1] <= hi]
        if sel:
            by_batch[f"{lo}-{hi}"] = {"steps": len(sel), "ms_per_step": round(1e3 * sum(sel) / len(sel), 3),
                                      "wait_ms_per_step": round(1e3 * sum(waits) / len(sel), 3)}
    full_gc = [d for g, d in pauses if g == 2]
    return {"decode_steps": len(decode), "decode_s": round(sum(r[2] for r in decode), 3), "mixed_steps": len(mixed),
            "mixed_s": round(sum(r[2] for r in mixed), 3), "mixed_wait_s": round(sum(r[3] for r in mixed), 3),
            "decode_by_batch": by_batch,
            "slowest_mixed_ms": sorted((round(1e3 * r[2], 1) for r in mixed), reverse=True)[:3],
            "gc_collections": len(pauses), "gc_s": round(sum(d for _, d in pauses), 3),
            "gc_full_s": round(sum(full_gc), 3),
            "graphs_compiled_during_run": counters["stats"]["unique_graphs"] - stats["graphs_before"]}


def run_hf_peer(args) -> dict:
    """Hugging Face transformers' continuous batching on the first --peer-num-seqs requests of the workload."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(args.model)
    with torch.device("cuda"):  # random weights made on the GPU: a large model's host init takes minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                 attn_implementation=args.peer_attn).eval()
    prompts, params = workload(args.num_seqs)
    prompts, params = prompts[: args.peer_num_seqs], params[: args.peer_num_seqs]
    gen = GenerationConfig(max_new_tokens=max(p.max_tokens for p in params), do_sample=True, temperature=0.6,
                           eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=[[1, 2, 3]], generation_config=gen, max_new_tokens=8)  # warm-up
    manager = model.init_continuous_batching(generation_config=gen)  # set up outside the clock, as nanoinfer's engine
    manager.start()
    start = time.perf_counter()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        manager.add_request(p, request_id=str(i), max_new_tokens=sp.max_tokens)
    tokens, done = 0, 0
    while done < len(prompts):
        result = manager.get_result(timeout=60)
        if result is not None and result.is_finished():
            tokens += len(result.generated_tokens)
            done += 1
    elapsed = time.perf_counter() - start
    manager.stop(block=True)
    return {"engine": f"transformers continuous batching ({args.peer_attn})", "num_seqs": len(prompts),
            "output_tokens": tokens, "seconds": round(elapsed, 3), "output_tok_per_s": round(tokens / elapsed, 1)}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--no-tqdm", action="store_true")
    p.add_argument("--step-stats", action="store_true", help="time every engine step (decode-only vs mixed)")
    p.add_argument("--repeat", type=int, default=1, help="timed runs of the workload in one engine (see above)")
    p.add_argument("--sampling", type=json.loads, default=None,
                   help='JSON of SamplingParams fields for every request, e.g. \'{"repetition_penalty": 1.1}\': a '
                        'variant of the workload (the reference figure is without it)')
    p.add_argument("--loras", type=int, default=0,
                   help="serve N random LoRA adapters (rank --max-lora-rank), request i with adapter i %% N: a "
                        "variant of the workload measuring LoRA's cost (the reference figure is without it)")
    p.add_argument("--peer", choices=["none", "hf"], default="none", help="also run a peer engine in the same run")
    p.add_argument("--peer-num-seqs", type=int, default=256, help="requests given to the peer (it is slow)")
    p.add_argument("--peer-attn", default="paged|sdpa", help="transformers attn_implementation for the peer")
    args = p.parse_args()
    ours = run_nanoinfer(args)
    figures = {"nanoinfer": ours}
    if args.peer == "hf":
        try:
            figures["peer"] = run_hf_peer(args)
        except Exception as e:  # the peer's API moves between transformers versions
            figures["peer"] = {"engine": "transformers continuous batching", "error": f"{type(e).__name__}: {e}"}
    report("throughput", figures, args)


if __name__ == "__main__":
    main()
