"""Where does a step's time go? Runs the engine to steady decode at a given
batch and context (or, with --prefill, to a warm single-request prefill), then
profiles steps: host functions with cProfile, device kernels with
torch.profiler, wall time per step, and how much of it the GPU was busy (the
rest is the idle gap between kernels that host work or waiting leaves).

    python bench/profile_step.py --batch 256 --context 1000 [--prefill | --workload] [--trace T.json] [engine flags]

--workload profiles the reference workload's first --steps steps (bench/throughput.py's requests, after its
warm-up): the mixed steps in which the 256 prompts are prefilled beside the decodes of those already admitted.

--trace writes a Chrome trace of the profiled steps (chrome://tracing, Perfetto) to see where the gaps are.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch

from common import engine_kwargs, parser, time_calls


def timed_steps(engine, num_steps: int) -> float:
    """Milliseconds per step over `num_steps` steps, device work included."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / num_steps * 1e3


def gpu_busy_us(events) -> float:
    """Time at least one kernel ran: the union of the GPU events' intervals (streams may overlap)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy


def host_phases(engine, num_steps: int) -> None:
    """Host milliseconds per step by phase, without a profiler's overhead: schedule, launch (inputs +
    graph replay or eager forward + sampler launch), wait (for the previous step's tokens: the host
    idles while the GPU is the bottleneck), update (scheduler bookkeeping), rest (output processing).
    A wait near zero means the GPU waits for the host instead."""
    core = engine.core
    runner = core.tp_driver or core.runner
    totals = dict.fromkeys(("schedule", "launch", "wait", "update"), 0.0)
    timed = [(core.scheduler, "schedule", "schedule"), (runner, "execute_model", "launch"),
             (core.scheduler, "update_from_output", "update")]
    for owner, name, phase in timed:
        time_calls(totals, owner, name, phase)
    synchronize = time_calls(totals, torch.cuda.Event, "synchronize", "wait")
    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        wall = time.perf_counter() - start
    finally:
        torch.cuda.Event.synchronize = synchronize
        for owner, name, _ in timed:
            del owner.__dict__[name]
    # update_from_output calls result(), so its time includes the wait: report them apart.
    totals["update"] -= totals["wait"]
    rest = wall - sum(totals.values())
    cells = ", ".join(f"{k} {v / num_steps * 1e3:.3f}" for k, v in (*totals.items(), ("rest", rest)))
    print(f"host phases, ms per step over {num_steps} steps: wall {wall / num_steps * 1e3:.3f} = {cells}")


def host_profile(engine, num_steps: int) -> None:
    """cProfile alone (no device profiler) over `num_steps` steps: where the host time goes."""
    host = cProfile.Profile()
    host.enable()
    for _ in range(num_steps):
        engine.step()
    torch.cuda.synchronize()
    host.disable()
    for order in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats(order).print_stats(30)
        print(text.getvalue()[:7000])


def profile(engine, num_steps: int, trace: str | None) -> None:
    """Host functions (cProfile) and device kernels (torch.profiler) of `num_steps` steps."""
    host = cProfile.Profile()
    host.enable()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as device:
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / num_steps
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(20)
    print(text.getvalue()[:5000])
    averages = device.key_averages()
    print(averages.table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    busy_ms = gpu_busy_us(device.events()) / 1e3 / num_steps
    print(f"per step under the profiler: wall {wall_ms:.3f} ms, GPU busy {busy_ms:.3f} ms, "
          f"idle {wall_ms - busy_ms:.3f} ms ({(wall_ms - busy_ms) / wall_ms:.0%})")
    if trace:
        device.export_chrome_trace(trace)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prefill", action="store_true", help="profile the first (prefill) steps instead of decode")
    p.add_argument("--host", action="store_true", help="only the host phases per step (no profilers)")
    p.add_argument("--workload", action="store_true", help="profile the reference workload's first (mixed) steps")
    p.add_argument("--trace", default=None, help="write a Chrome trace of the profiled steps to this file")
    args = p.parse_args()
    from nanoinfer import LLM, SamplingParams

    engine = LLM(**engine_kwargs(args)).llm_engine
    max_tokens = 10_000 if args.max_model_len is None else args.max_model_len - args.context - 1
    params = SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True)
    if args.workload:
        from throughput import warm_up, workload

        warm_up(engine)
        for i, (prompt, sp) in enumerate(zip(*workload(256))):
            engine.add_request(str(i), prompt, sp)
        if args.host:
            host_phases(engine, args.steps)
            host_profile(engine, args.steps)
        else:
            profile(engine, args.steps, args.trace)
        return
    if args.prefill:
        # A warm prefill, as the latency benchmark's TTFT sees it: one earlier request runs to the
        # end first (compilation, allocator growth), then a new one's first step is profiled.
        prompt = [(7 * j) % 10000 for j in range(args.context)]
        engine.add_request("warm-up", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        for k in range(3):
            engine.add_request(f"prefill{k}", [(t + k + 1) % 10000 for t in prompt], SamplingParams(max_tokens=1, ignore_eos=True))
            print(f"warm prefill step {k}: {timed_steps(engine, 1):.1f} ms")
            while engine.has_unfinished_requests():
                engine.step()
        engine.add_request("profiled", [(t + 99) % 10000 for t in prompt], SamplingParams(max_tokens=1, ignore_eos=True))
        profile(engine, 1, args.trace)
        return
    for i in range(args.batch):
        engine.add_request(str(i), [(i * 7 + j) % 10000 for j in range(args.context)], params)
    while len(engine.core.scheduler.waiting) or any(r.num_output_tokens == 0 for r in engine.core.scheduler.running):
        engine.step()
    timed_steps(engine, 5)  # settle
    print(f"wall per decode step at batch {args.batch}, context ~{args.context}: {timed_steps(engine, args.steps):.3f} ms")
    host_phases(engine, args.steps)
    if args.host:
        return
    profile(engine, 10, args.trace)


if __name__ == "__main__":
    main()
