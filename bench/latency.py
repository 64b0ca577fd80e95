"""Single-stream latency: one request, 128-token prompt, 512 greedy output
tokens; time to first token (TTFT) and time per output token (TPOT).

    python bench/latency.py [engine flags]
"""

from __future__ import annotations

import statistics
import time
from random import randint, seed

from common import engine_kwargs, parser, report


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args()
    from nanoinfer import LLM, SamplingParams

    llm = LLM(**engine_kwargs(args))
    engine = llm.llm_engine
    seed(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    ttfts, tpots = [], []
    for it in range(args.iters + 1):  # the first iteration warms up
        prompt = [randint(0, 10000) for _ in range(args.input_len)]
        start = time.perf_counter()
        engine.add_request(f"lat{it}", prompt, params)
        first, step_ends = None, []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter()
            if len(step_ends) < 4:
                step_ends.append(round((time.perf_counter() - start) * 1e3, 2))
        end = time.perf_counter()
        if it:
            ttfts.append(first - start)
            tpots.append((end - first) / (args.output_len - 1))
    report("latency", {"input_len": args.input_len, "output_len": args.output_len,
                       "ttft_ms": round(statistics.median(ttfts) * 1e3, 2),
                       "tpot_ms": round(statistics.median(tpots) * 1e3, 3),
                       "first_step_ends_ms": step_ends}, args)


if __name__ == "__main__":
    main()
