"""Where does a decode step's time go? Runs the engine to steady decode at a
given batch and context, then profiles a few steps (host functions with
cProfile, device kernels with torch.profiler) and prints wall time per step.

    python bench/profile_step.py --batch 256 --context 1000 [engine flags]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

from common import engine_kwargs, parser


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prefill", action="store_true", help="profile the first (prefill) steps instead of decode")
    args = p.parse_args()
    import torch

    from nanoinfer import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    engine = llm.engine
    params = SamplingParams(temperature=0.6, max_tokens=10_000 if args.max_model_len is None else args.max_model_len - args.context - 1, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), [(i * 7 + j) % 10000 for j in range(args.context)], params)
    if args.prefill:
        torch.cuda.synchronize()
        for k in range(4):
            start = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            print(f"prefill step {k}: {(time.perf_counter() - start) * 1e3:.1f} ms")
        prof = cProfile.Profile()
        prof.enable()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as tp:
            engine.step()
            torch.cuda.synchronize()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
        print(s.getvalue()[:4000])
        print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))
        return
    while len(engine.core.scheduler.waiting) or any(r.num_output_tokens == 0 for r in engine.core.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    print(f"wall per decode step at batch {args.batch}, context ~{args.context}: "
          f"{(time.perf_counter() - start) / args.steps * 1e3:.3f} ms")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue()[:6000])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as tp:
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
    print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
