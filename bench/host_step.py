"""Host work per decode step, on any machine (no GPU needed): where the engine's own Python time goes when
`--num-seqs` requests decode together, phase by phase.

    python bench/host_step.py [--num-seqs 256] [--steps 200] [--no-async-scheduling] [--speculative-config JSON]

On a GPU the host must stay ahead of the device (async scheduling plans step N+1 while step N runs), so
this is the budget that bounds a step when the GPU is fast (the fp8 KV cache at large batches, small
models, serving). The model is the reference shape (Qwen3) shrunk to one tiny layer and a 2,048-token
vocabulary, with dummy weights, on the CPU: its "device work" (forward, LM head, sampler) is reported
apart from the host phases, which do not depend on the model's size. Prompts and sampling are the
reference workload's (seed 0, 100-1024 random tokens, temperature 0.6, ignore_eos), every request
decoding throughout; outputs are built when requests finish, as `LLM.generate` does. Run two trees
through `PYTHONPATH` (bench/common.py) to compare revisions in one run.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from random import randint, seed

from common import QWEN3_06B, GcPauses, engine_kwargs, parser, report, time_calls

DEVICE_WORK = ("model forward", "lm head", "sampler")


def tiny_reference_model(folder: str) -> str:
    """The reference config shrunk to one tiny layer: host work per step is the same, device work ~nothing."""
    with open(QWEN3_06B) as f:
        config = json.load(f)
    config.update(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, vocab_size=2048, bos_token_id=0, eos_token_id=1)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def measure(args) -> dict:
    import torch

    from nanoinfer import LLM, SamplingParams
    from nanoinfer.model_runner.output import RunnerFuture
    from nanoinfer.sampling_params import RequestOutputKind

    torch.set_num_threads(1)  # the device work stays small and out of the host phases' way
    llm = LLM(**engine_kwargs(args))
    engine = llm.llm_engine
    seed(0)
    for i in range(args.num_seqs):
        prompt = [randint(2, 2000) for _ in range(randint(100, 1024))]
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.steps + 64,
                                                          output_kind=RequestOutputKind.FINAL_ONLY))
    scheduler = engine.core.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    for _ in range(10):
        engine.step()
    if len(scheduler.running) != args.num_seqs:
        raise RuntimeError(f"{len(scheduler.running)} of {args.num_seqs} requests run: give a larger KV cache")

    phases: dict[str, float] = {}
    runner = engine.core.runner
    for owner, name, phase in ((scheduler, "schedule", "schedule"), (runner, "_prepare_inputs", "prepare inputs"),
                               (runner, "_sampling_metadata", "sampling metadata"),
                               (runner.model, "forward", "model forward"), (runner.model, "compute_logits", "lm head"),
                               (runner, "sampler", "sampler"), (RunnerFuture, "result", "read back tokens"),
                               (scheduler, "update_from_output", "update"),
                               (engine.output_processor, "process_outputs", "output processing")):
        time_calls(phases, owner, name, phase)
    collector = GcPauses().start()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = time.perf_counter() - start
    collector.stop()
    llm.close()

    by_generation: dict[int, list[float]] = {}
    for generation, seconds in collector.pauses:
        by_generation.setdefault(generation, []).append(seconds)
    ms = {phase: round(1e3 * seconds / args.steps, 3) for phase, seconds in phases.items()}
    host = {phase: value for phase, value in ms.items() if phase not in DEVICE_WORK}
    device = sum(ms[phase] for phase in DEVICE_WORK)
    return {"num_seqs": args.num_seqs, "steps": args.steps, "async_scheduling": args.async_scheduling,
            "host_ms_per_step": round(1e3 * wall / args.steps - device, 3), "host_phases_ms": host,
            "other_host_ms": round(1e3 * wall / args.steps - sum(ms.values()), 3),
            "device_work_on_cpu_ms": round(device, 3),
            "gc": {f"gen{g}": {"collections": len(seconds), "ms_per_step": round(1e3 * sum(seconds) / args.steps, 3)}
                   for g, seconds in sorted(by_generation.items())}}


def main() -> None:
    p = parser(__doc__, model_default=None)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    with tempfile.TemporaryDirectory() as folder:
        p.set_defaults(model=tiny_reference_model(folder), device="cpu", dtype="float32", max_model_len=2048,
                       kv_cache_memory_bytes=256 << 20)
        args = p.parse_args()
        report("host_step", measure(args), args)


if __name__ == "__main__":
    main()
