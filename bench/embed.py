"""Embedding throughput (runner="pooling"): the reference workload's 256 prompts (seed 0, 100-1024 random token
ids each, ~144k tokens), Qwen3-0.6B shape with dummy weights, LAST pooling; prompt tokens per second.

    python bench/embed.py [--peer hf] [--repeat N] [engine flags]

Each repeat embeds the same prompts again with the prefix cache reset first, so every run computes every token.
--peer hf: transformers' AutoModel on the same prompts in the same run, batches of --peer-batch prompts padded
to their longest (sdpa), the last real token's hidden state pooled and normalized as ours.
"""

from __future__ import annotations

import time

from common import engine_kwargs, parser, report
from throughput import workload


def run_nanoinfer(args) -> dict:
    from nanoinfer import LLM

    llm = LLM(**engine_kwargs(args))
    prompts, _ = workload(args.num_seqs)
    llm.embed([p[:64] for p in prompts[:32]], use_tqdm=False)  # warm-up (kernels compiled)
    runs = []
    for _ in range(args.repeat):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.embed(prompts, use_tqdm=False)
        runs.append(time.perf_counter() - start)
    assert len(outputs) == len(prompts) and all(len(o.outputs.embedding) == llm.llm_engine.core.source.hf_config.hidden_size
                                                for o in outputs)
    llm.close()
    tokens = sum(map(len, prompts))
    return {"engine": "nanoinfer", "num_seqs": len(prompts), "prompt_tokens": tokens,
            "seconds": [round(s, 3) for s in runs], "prompt_tok_per_s": round(tokens / min(runs), 1)}


def run_hf_peer(args) -> dict:
    import torch
    from transformers import AutoConfig, AutoModel

    model = AutoModel.from_config(AutoConfig.from_pretrained(args.model), dtype=torch.bfloat16,
                                  attn_implementation="sdpa").cuda().eval()
    prompts, _ = workload(args.num_seqs)

    def embed_all() -> None:
        for first in range(0, len(prompts), args.peer_batch):
            batch = prompts[first : first + args.peer_batch]
            width = max(map(len, batch))
            ids = torch.tensor([p + [0] * (width - len(p)) for p in batch], device="cuda")
            mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in batch], device="cuda")
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(batch), device="cuda"), mask.sum(dim=1) - 1]
            torch.nn.functional.normalize(last.float(), dim=-1).cpu()

    with torch.inference_mode():
        embed_all()  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        embed_all()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    tokens = sum(map(len, prompts))
    return {"engine": f"transformers AutoModel (sdpa, batches of {args.peer_batch}, padded)", "num_seqs": len(prompts),
            "prompt_tokens": tokens, "seconds": round(elapsed, 3), "prompt_tok_per_s": round(tokens / elapsed, 1)}


def main() -> None:
    p = parser(__doc__)
    p.set_defaults(runner="pooling")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3, help="timed runs; the figure is the fastest")
    p.add_argument("--peer", choices=["none", "hf"], default="none", help="also run a peer in the same run")
    p.add_argument("--peer-batch", type=int, default=32)
    args = p.parse_args()
    figures = {"nanoinfer": run_nanoinfer(args)}
    if args.peer == "hf":
        figures["peer"] = run_hf_peer(args)
    report("embed", figures, args)


if __name__ == "__main__":
    main()
