"""Speculative decoding by n-gram lookup: time per output token with and without drafts, one request at a time
and as a batch, on chat tasks whose replies copy from their prompt (where n-gram drafts are right) and on
open-ended ones (where they are not). The embedded SmolLM2-135M-Instruct by default: drafts need real weights
(a dummy model's output is noise, or loops that flatter the drafts). Also checks the promise: the same tokens
(`*_same_tokens`: of the 4 replies, how many are equal; `*_common_prefix`: the mean fraction they agree on first).

    python bench/spec_decode.py [--num-speculative-tokens K] [--prompt-lookup-max N] [engine flags]
"""

from __future__ import annotations

import gc
import statistics
import time

from common import engine_kwargs, parser, report

CODE = """def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for value in values:
        total += (value - m) ** 2
    return total / len(values)
"""
TEXT = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, the "
        "members agreed to increase funding for the library, to repair the roof of the town hall, and to hire two "
        "more teachers for the primary school. The proposal to build a new parking lot was postponed until spring.")
COPYING = [
    f"Rename the function mean to average everywhere in this code and show the whole code:\n\n{CODE}",
    f"Repeat the following paragraph word for word:\n\n{TEXT}",
    "Write the numbers from 1 to 60, separated by commas.",
    f"Add a docstring to each function and show the whole code:\n\n{CODE}",
]
OPEN = ["Write a short story about a lighthouse keeper.", "Explain why the sky is blue.",
        "Give three tips for learning to cook.", "Describe your ideal weekend."]


def run(llm, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], float, float]:
    """Each prompt alone (median time per output token after the first), then eight copies of all at once
    (output tok/s). Returns the single runs' tokens too."""
    from nanoinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    ids = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    llm.generate(ids[:1], params, use_tqdm=False)  # warm-up
    engine, tokens, tpots = llm.llm_engine, [], []
    for i, prompt in enumerate(ids):
        engine.add_request(f"alone{i}", prompt, params)
        first = out = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter()
        n = len(out.outputs[0].token_ids)
        tpots.append((time.perf_counter() - first) / max(n - 1, 1))
        tokens.append(out.outputs[0].token_ids)
    start = time.perf_counter()
    outs = llm.generate(ids * 8, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return tokens, statistics.median(tpots), sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def main() -> None:
    p = parser(__doc__, model_default=None, load_format_default="auto")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=3)
    p.add_argument("--prompt-lookup-min", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args()
    import torch

    from nanoinfer import LLM

    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    kwargs = engine_kwargs(args)
    kwargs.pop("speculative_config", None)
    figures, tokens = {"speculative_config": spec}, {}
    for label, extra in (("plain", {}), ("ngram", {"speculative_config": spec})):
        llm = LLM(**kwargs, **extra)
        for kind, prompts in (("copying", COPYING), ("open", OPEN)):
            before = llm.llm_engine.core.stats()
            tokens[label, kind], tpot, batch = run(llm, prompts, args.max_tokens)
            after = llm.llm_engine.core.stats()
            figures[f"{label}_{kind}_tpot_ms"] = round(tpot * 1e3, 3)
            figures[f"{label}_{kind}_batch_tok_s"] = round(batch, 1)
            drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
            if drafted:
                figures[f"{label}_{kind}_acceptance"] = round(
                    (after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens) / drafted, 3)
        llm.close()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for kind in ("copying", "open"):
        figures[f"{kind}_speedup_single"] = round(figures[f"plain_{kind}_tpot_ms"] / figures[f"ngram_{kind}_tpot_ms"], 2)
        # Equal in float32; in bf16 a drafted step computes a position with other kernels (prefill attention, other
        # GEMM shapes) than a one-token step, so a near-tie can round the other way and the texts part there.
        pairs = list(zip(tokens["plain", kind], tokens["ngram", kind]))
        figures[f"{kind}_same_tokens"] = sum(a == b for a, b in pairs)
        figures[f"{kind}_common_prefix"] = round(statistics.mean(
            next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) / max(len(a), 1)
            for a, b in pairs), 3)
    report("spec_decode", figures, args)


if __name__ == "__main__":
    main()
