"""Decode tokens/s of the embedded SmolLM2-135M at batch 1 and batch 16, our
engine against transformers `generate` on the same weights and machine.

    python bench/cpu_decode.py [--batch-sizes 1 16] [--output-len 64]
"""

from __future__ import annotations

import time

from common import engine_kwargs, parser, report


def prompts(batch: int) -> list[str]:
    return [f"Write a short story about a robot named R{i} who learns to paint." for i in range(batch)]


def ours(llm, batch: int, output_len: int) -> float:
    from nanoinfer import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts(batch), SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts(batch), params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def transformers_generate(model_path: str, batch: int, output_len: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    enc = tok(prompts(batch), return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.no_grad():
        model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.eos_token_id)  # warm-up
        start = time.perf_counter()
        model.generate(**enc, **kwargs)
    return batch * output_len / (time.perf_counter() - start)


def main() -> None:
    p = parser(__doc__, model_default=None, load_format_default="auto")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    from nanoinfer import LLM

    if args.kv_cache_memory_bytes is None:
        args.kv_cache_memory_bytes = 256 << 20
    llm = LLM(**engine_kwargs(args))
    model_path = llm.llm_engine.core.source.model_path
    figures = {}
    for batch in args.batch_sizes:
        figures[f"batch{batch}"] = {"nanoinfer_tok_per_s": round(ours(llm, batch, args.output_len), 1),
                                    "transformers_tok_per_s": round(transformers_generate(model_path, batch, args.output_len), 1)}
        print(batch, figures[f"batch{batch}"], flush=True)
    report("cpu_decode", {"model": "SmolLM2-135M-Instruct (float32)", "output_len": args.output_len, **figures}, args)


if __name__ == "__main__":
    main()
