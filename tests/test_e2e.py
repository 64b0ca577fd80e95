"""End to end: our greedy output equals Hugging Face transformers token for
token on the same weights, and stays the same under prefix-cache hits,
chunked prefill, preemption and batching."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from logprobs_close import approx_logprobs

from nanoinfer import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village, there lived"]
NUM_TOKENS = 24
SMALL_KV = 64 << 20


def greedy(n: int = NUM_TOKENS, **kw) -> SamplingParams:
    # min_tokens = max_tokens masks eos in both engines, so both emit exactly n tokens.
    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, **kw)


def hf_greedy(model_path: str, prompts_ids: list[list[int]], n: int = NUM_TOKENS) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts_ids:
            x = torch.tensor([ids])
            gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=model.config.eos_token_id)
            outs.append(gen[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="module")
def smol() -> LLM:
    return LLM(kv_cache_memory_bytes=SMALL_KV)  # None: the embedded default model


def test_smollm2_greedy_matches_transformers(smol: LLM, smollm2_path: str) -> None:
    ours = smol.generate(PROMPTS, greedy(), use_tqdm=False)
    prompt_ids = [o.prompt_token_ids for o in ours]
    assert prompt_ids[0] == smol.tokenizer.encode(PROMPTS[0])
    assert [o.outputs[0].token_ids for o in ours] == hf_greedy(smollm2_path, prompt_ids)
    assert all(o.outputs[0].text for o in ours)


def test_smollm2_logprobs_match_transformers(smol: LLM, smollm2_path: str) -> None:
    """First-token top-20 logprobs within 1e-4 of transformers' log_softmax (float32 on CPU)."""
    from transformers import AutoModelForCausalLM

    out = smol.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1, logprobs=20), use_tqdm=False)[0]
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([out.prompt_token_ids])).logits[0, -1].log_softmax(-1)
    ours = out.outputs[0].logprobs[0]
    assert len(ours) >= 20
    for token_id, logprob in ours.items():
        assert abs(logprob.logprob - ref[token_id].item()) < 1e-4
        assert logprob.decoded_token == smol.tokenizer.decode([token_id], skip_special_tokens=False)
    assert set(ours) >= set(ref.topk(20).indices.tolist())
    sampled = out.outputs[0].token_ids[0]  # greedy: the most likely token, rank 1; the others ranked in order
    assert ours[sampled].rank == 1 and [lp.rank for t, lp in ours.items() if t != sampled] == list(range(2, 21))


def test_smollm2_with_fp8_kv_cache_tracks_full_precision(smol: LLM) -> None:
    """kv_cache_dtype="fp8" (float8_e4m3fn K/V, PyTorch path): a quarter of the float32 cache's bytes
    per token, so four times the blocks in the same budget, and on real weights the greedy text
    stays that of the full-precision cache for its first tokens (measured: 24, 13 and 24 of 24) and
    the first token's log-probability within 0.2 (measured: 0.06)."""
    fp8 = LLM(kv_cache_memory_bytes=SMALL_KV, kv_cache_dtype="fp8")
    assert fp8.llm_engine.core.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert fp8.llm_engine.core.num_blocks == 4 * smol.llm_engine.core.num_blocks
    full = [o.outputs[0] for o in smol.generate(PROMPTS, greedy(logprobs=1), use_tqdm=False)]
    ours = [o.outputs[0] for o in fp8.generate(PROMPTS, greedy(logprobs=1), use_tqdm=False)]
    for a, b in zip(full, ours):
        assert a.token_ids[:8] == b.token_ids[:8]
        first = a.token_ids[0]
        assert abs(a.logprobs[0][first].logprob - b.logprobs[0][first].logprob) < 0.2
    fp8.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_greedy_match_transformers(tiny_models: dict[str, str], arch: str) -> None:
    prompts = [[(7 * i + 3 * j) % 256 for j in range(5 + 9 * i)] for i in range(4)]
    llm = LLM(tiny_models[arch], kv_cache_memory_bytes=SMALL_KV)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    assert ours == hf_greedy(tiny_models[arch], prompts)


def _tiny_prompts() -> list[list[int]]:
    shared = [(11 * j + 5) % 256 for j in range(40)]  # a 40-token shared prefix
    return [shared + [(13 * i + j) % 256 for j in range(3 + 4 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def tiny_reference(tiny_models) -> list[list[int]]:
    """One request at a time, no prefix caching, big budget: the plain reference."""
    llm = LLM(tiny_models["llama"], enable_prefix_caching=False, kv_cache_memory_bytes=SMALL_KV, block_size=4)
    return [llm.generate(p, greedy(32), use_tqdm=False)[0].outputs[0].token_ids for p in _tiny_prompts()]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(_tiny_prompts(), greedy(32), use_tqdm=False)]


def test_batched_equals_one_at_a_time(tiny_models, tiny_reference) -> None:
    llm = LLM(tiny_models["llama"], enable_prefix_caching=False, kv_cache_memory_bytes=SMALL_KV, block_size=4)
    assert _tokens(llm) == tiny_reference


def test_prefix_cache_hits_keep_outputs(tiny_models, tiny_reference) -> None:
    llm = LLM(tiny_models["llama"], kv_cache_memory_bytes=SMALL_KV, block_size=4)
    assert _tokens(llm) == tiny_reference
    outs = llm.generate(_tiny_prompts(), greedy(32), use_tqdm=False)  # every prompt is cached now
    assert [o.outputs[0].token_ids for o in outs] == tiny_reference
    assert all(o.num_cached_tokens >= 40 for o in outs)
    assert llm.llm_engine.core.scheduler.kv_cache_manager.prefix_hits > 0
    assert llm.reset_prefix_cache() is True  # nothing running: every cached prefix is forgotten
    outs = llm.generate(_tiny_prompts(), greedy(32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == tiny_reference
    assert outs[0].num_cached_tokens == 0  # the first prompt prefilled again (later ones share its prefix)


def test_decode_steps_carry_the_longest_first_order(tiny_models, tiny_reference, monkeypatch) -> None:
    """Every decode step's metadata orders its sequences longest context first (ties in batch order), the order
    decode attention launches them in on a GPU; prefill and mixed steps carry none. Outputs are unchanged."""
    from nanoinfer.attention.torch_backend import TorchAttentionBackend

    steps = []
    forward = TorchAttentionBackend.forward

    def spy(self, query, k_cache, v_cache, metadata, scale):
        order = None if metadata.seq_order is None else metadata.seq_order.tolist()
        steps.append((metadata.is_decode_only, list(metadata.seq_lens_cpu), order))
        return forward(self, query, k_cache, v_cache, metadata, scale)

    monkeypatch.setattr(TorchAttentionBackend, "forward", spy)
    llm = LLM(tiny_models["llama"], kv_cache_memory_bytes=SMALL_KV, block_size=4)
    assert _tokens(llm) == tiny_reference
    decode = [(lens, order) for is_decode, lens, order in steps if is_decode]
    assert decode and all(order is None for is_decode, _, order in steps if not is_decode)
    for lens, order in decode:
        assert order == sorted(range(len(lens)), key=lambda i: -lens[i])
    assert any(len(set(lens)) > 1 for lens, _ in decode)  # the order was not the batch's own


def test_chunked_prefill_keeps_outputs(tiny_models, tiny_reference) -> None:
    llm = LLM(tiny_models["llama"], max_num_batched_tokens=7, kv_cache_memory_bytes=SMALL_KV, block_size=4)
    assert _tokens(llm) == tiny_reference


def test_preemption_keeps_outputs(tiny_models, tiny_reference) -> None:
    # 24 blocks of 4 tokens: each request needs up to 20 blocks, so six at once must preempt.
    llm = LLM(tiny_models["llama"], num_kv_blocks=24, block_size=4)
    assert _tokens(llm) == tiny_reference
    scheduler = llm.llm_engine.core.scheduler
    assert scheduler.num_preemptions > 0
    assert scheduler.kv_cache_manager.num_free_blocks == 24


def test_n_samples_share_prompt_blocks(tiny_models) -> None:
    llm = LLM(tiny_models["llama"], kv_cache_memory_bytes=SMALL_KV, block_size=4)
    out = llm.generate([list(range(1, 42))], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds per sample
    assert llm.llm_engine.core.scheduler.kv_cache_manager.prefix_hits >= 2 * 40  # children 2 and 3 hit the prompt


def test_seeded_sampling_reproducible_across_batches(tiny_models) -> None:
    llm = LLM(tiny_models["llama"], kv_cache_memory_bytes=SMALL_KV)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=123, max_tokens=16)
    alone = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [[5, 6, 7, 8], [9] * 12]
    batched = llm.generate([[1, 2, 3]] + others, [params, SamplingParams(temperature=1.0, max_tokens=16)] * 1
                           + [SamplingParams(temperature=1.0, max_tokens=16)], use_tqdm=False)
    assert batched[0].outputs[0].token_ids == alone


def test_sampling_metadata_is_rebuilt_only_when_it_can_change(tiny_models, monkeypatch) -> None:
    """A decode step whose batch is last step's requests, none seeded or penalised, reuses last step's
    sampling metadata; a changed batch, or any row that samples differently each step, rebuilds it."""
    from nanoinfer.sample.metadata import SamplingMetadata

    builds = []
    build = SamplingMetadata.build.__func__
    monkeypatch.setattr(SamplingMetadata, "build", classmethod(lambda cls, *a, **k: builds.append(1) or build(cls, *a, **k)))
    llm = LLM(tiny_models["llama"], kv_cache_memory_bytes=SMALL_KV)
    plain = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    llm.generate([[1, 2, 3], [4, 5, 6, 7]], [plain, SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True)],
                 use_tqdm=False)
    # The first step's batch, then the pair decodes until one finishes, then the survivor alone.
    assert 2 <= len(builds) <= 4
    penalized = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, presence_penalty=0.5)
    builds.clear()  # penalties count on the device: their rows sample alike from step to step
    llm.generate([[1, 2, 3], [4, 5, 6, 7]], [plain, penalized], use_tqdm=False)
    assert len(builds) <= 2
    seeded = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=5)
    builds.clear()
    llm.generate([[1, 2, 3], [4, 5, 6, 7]], [plain, seeded], use_tqdm=False)
    assert len(builds) == 12  # every step that samples
    below = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, min_tokens=3)
    builds.clear()  # the min_tokens mask changes until the request has its 3 tokens, then the metadata stays
    llm.generate([[1, 2, 3], [4, 5, 6, 7]], [plain, below], use_tqdm=False)
    assert 4 <= len(builds) <= 6


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_async_and_sync_scheduling_agree_under_preemption(tiny_models, tiny_reference, async_scheduling) -> None:
    llm = LLM(tiny_models["llama"], num_kv_blocks=24, block_size=4, max_num_batched_tokens=9,
              async_scheduling=async_scheduling)
    assert _tokens(llm) == tiny_reference
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    assert not llm.llm_engine.core.has_unfinished_requests()


def _penalised_greedy_reference(model_path: str, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    """Greedy with penalties from the whole history, step by step over transformers' logits."""
    from test_sampler import direct_penalties
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    output: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([prompt + output])).logits[0, -1].tolist()
            penalised = direct_penalties(logits, prompt, output, params)
            output.append(max(range(len(penalised)), key=penalised.__getitem__))
    return output


@pytest.mark.parametrize("engine", [dict(), dict(async_scheduling=False),
                                    dict(num_kv_blocks=24, block_size=4, max_num_batched_tokens=9)],
                         ids=["async", "sync", "preempted"])
def test_penalised_greedy_matches_a_direct_computation(tiny_models, engine) -> None:
    """Repetition, presence and frequency penalties from the device-side token counts equal the penalties
    computed from each request's whole history, step by step over transformers' logits: with async scheduling
    (no wait for the newest token), synchronously, and with preemptions (counts rebuilt from the tokens)."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.4, frequency_penalty=0.3)
    llm = LLM(tiny_models["llama"], **({"kv_cache_memory_bytes": SMALL_KV} | engine))
    ours = [o.outputs[0].token_ids for o in llm.generate(_tiny_prompts(), params, use_tqdm=False)]
    if "num_kv_blocks" in engine:
        assert llm.llm_engine.core.scheduler.num_preemptions > 0
    for prompt, got in zip(_tiny_prompts(), ours):
        assert got == _penalised_greedy_reference(tiny_models["llama"], prompt, params, 16)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_a_readmitted_penalised_request_gets_a_slot_of_its_own(tiny_models, async_scheduling) -> None:
    """A penalized request preempted by a more important one that is then aborted comes back under its id and
    samples alone again: the sampling metadata of its old state (whose penalty slot was closed) must not serve it."""
    from nanoinfer.config import EngineConfig
    from nanoinfer.engine.llm_engine import LLMEngine

    params = SamplingParams(temperature=0, max_tokens=44, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.4, frequency_penalty=0.3)
    prompt = [(7 * j + 3) % 256 for j in range(20)]
    engine = LLMEngine(EngineConfig(model=tiny_models["llama"], async_scheduling=async_scheduling, block_size=4,
                                    num_kv_blocks=16, max_num_batched_tokens=8, scheduling_policy="priority",
                                    max_num_seqs=4))
    engine.add_request("B", prompt, params, priority=1)
    outputs = {}
    for _ in range(32):
        outputs.update({o.request_id: o for o in engine.step()})
    engine.add_request("A", [(5 * j + 1) % 256 for j in range(44)], SamplingParams(temperature=0, max_tokens=4))
    while engine.core.scheduler.num_preemptions == 0:
        outputs.update({o.request_id: o for o in engine.step()})
    engine.abort_request("A")
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    assert outputs["B"].outputs[0].token_ids == _penalised_greedy_reference(tiny_models["llama"], prompt, params, 44)
    engine.step()  # the runner hears of the finish, and frees the slot
    assert len(engine.core.runner.penalties._free) == 4


def test_seeded_penalised_sampling_same_sync_and_async(tiny_models) -> None:
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=20, presence_penalty=0.5, min_tokens=5)
    outs = []
    for async_scheduling in (False, True):
        llm = LLM(tiny_models["llama"], kv_cache_memory_bytes=SMALL_KV, async_scheduling=async_scheduling)
        outs.append([o.outputs[0].token_ids for o in llm.generate(_tiny_prompts(), params, use_tqdm=False)])
    assert outs[0] == outs[1]


def test_stop_token_ids_end_the_request(tiny_models, tiny_reference) -> None:
    """A stop_token_ids hit ends the request with finish_reason 'stop' and reports the token;
    min_tokens holds it back until enough tokens are out."""
    llm = LLM(tiny_models["llama"], kv_cache_memory_bytes=SMALL_KV, block_size=4)
    reference = tiny_reference[0]
    stop = reference[5]
    first = reference.index(stop)
    out = llm.generate(_tiny_prompts()[0], SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    later = llm.generate(_tiny_prompts()[0], SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop],
                                                            min_tokens=first + 2), use_tqdm=False)[0].outputs[0]
    assert len(later.token_ids) > first + 1 and stop not in later.token_ids[: first + 1]


def test_output_kinds(smol: LLM) -> None:
    """CUMULATIVE outputs grow; DELTA outputs add up to the same completion (text, tokens,
    logprobs, with a stop string held back until it cannot leak); FINAL_ONLY gives one output.
    Both children of an n=2 request are tracked separately."""
    from nanoinfer import RequestOutputKind

    engine = smol.llm_engine
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=20, logprobs=2, stop=[" the"])
    seen: dict[RequestOutputKind, list] = {}
    for kind in RequestOutputKind:
        engine.add_request(kind.value, PROMPTS[2], dataclasses.replace(params, output_kind=kind))
        seen[kind] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[RequestOutputKind(out.request_id)].append(out)
    cumulative, delta, final = (seen[k] for k in RequestOutputKind)
    assert len(final) == 1 and final[0].finished and len(delta) > 2 and len(cumulative) == len(delta)
    for index in (0, 1):
        whole = final[0].outputs[index]
        last = cumulative[-1].outputs[index]
        assert (last.index, last.text, last.token_ids, last.finish_reason, last.stop_reason) == (
            whole.index, whole.text, whole.token_ids, whole.finish_reason, whole.stop_reason)
        assert last.logprobs == approx_logprobs(whole.logprobs)  # another request: another batch row
        parts = [c for o in delta for c in o.outputs if c.index == index]
        assert "".join(p.text for p in parts) == whole.text
        assert [t for p in parts for t in p.token_ids] == whole.token_ids
        assert [lp for p in parts for lp in p.logprobs] == approx_logprobs(whole.logprobs)
        assert parts[-1].finish_reason == whole.finish_reason
        lengths = [len(o.outputs[index].token_ids) for o in cumulative]
        assert lengths == sorted(lengths)
    assert all(c.token_ids or c.finish_reason for o in delta for c in o.outputs)  # only what is new
    assert final[0].outputs[0].text != final[0].outputs[1].text  # seeded per child: two samples


def test_frozen_heap_is_collected_at_exit() -> None:
    """The frozen start-up heap goes back to the collector at exit, so objects in reference
    cycles are finalised then (frozen ones never are: triton's bindings then report them all
    as leaks after every run)."""
    import subprocess
    import sys

    script = ("from nanoinfer.engine.core import _freeze_startup_heap\n"
              "class Node:\n"
              "    def __del__(self):\n"
              "        print('finalized', flush=True)\n"
              "node = Node()\n"
              "node.me = node\n"
              "_freeze_startup_heap()\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "finalized"
    assert "leaked" not in run.stderr


def test_dropped_engines_are_freed(smollm2_path) -> None:
    """The first engine of a process freezes the start-up heap out of the garbage collector's
    view (full collections during a run stay short); engines themselves, and any created later,
    remain collectable: a dropped LLM is freed."""
    import gc
    import weakref

    from nanoinfer.engine import core

    first = LLM(smollm2_path, device="cpu", kv_cache_memory_bytes=1 << 24)
    assert core._heap_frozen and gc.get_freeze_count() > 0
    frozen = gc.get_freeze_count()
    second = LLM(smollm2_path, device="cpu", kv_cache_memory_bytes=1 << 24)
    assert gc.get_freeze_count() == frozen  # not again: the first engine stays collectable
    refs = [weakref.ref(first.llm_engine.core), weakref.ref(second.llm_engine.core)]
    del first, second
    gc.collect()
    assert [r() for r in refs] == [None, None]


# ----- prompt logprobs -----


def _hf_prompt_logprobs(model_path: str, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row i is the distribution of token i + 1 given tokens 0..i (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)


def _check_prompt_logprobs(entries: list, ids: list[int], ref: torch.Tensor, top_n: int, tol: float = 1e-4) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for i, entry in enumerate(entries[1:]):
        own = entry[ids[i + 1]]  # the prompt's own token, with its rank in the reference's distribution
        assert own.logprob == pytest.approx(ref[i, ids[i + 1]].item(), abs=tol)
        assert own.rank == int((ref[i] >= ref[i, ids[i + 1]]).sum())
        top = sorted((lp.logprob for lp in entry.values()), reverse=True)[:top_n]
        assert top == pytest.approx(ref[i].topk(top_n).values.tolist(), abs=tol)
        assert top_n <= len(entry) <= top_n + 1


def test_smollm2_prompt_logprobs_match_transformers(smol: LLM, smollm2_path: str) -> None:
    out = smol.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5), use_tqdm=False)[0]
    _check_prompt_logprobs(out.prompt_logprobs, out.prompt_token_ids,
                           _hf_prompt_logprobs(smollm2_path, out.prompt_token_ids), 5)


def test_prompt_logprobs_survive_chunks_cached_prefixes_preemption_and_n(tiny_models) -> None:
    """Each prompt position once, whatever computes it: prefill cut into chunks, a prompt whose blocks are cached
    (a prompt_logprobs request reads none of them, so every position is computed), recompute after preemption, n."""
    from nanoinfer.sampling_params import RequestOutputKind

    path = tiny_models["llama"]
    prompts = _tiny_prompts()
    refs = [_hf_prompt_logprobs(path, p) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, prompt_logprobs=2)

    chunked = LLM(path, max_num_batched_tokens=7, kv_cache_memory_bytes=SMALL_KV, block_size=4)
    chunked.generate(prompts, greedy(4), use_tqdm=False)  # every prompt's blocks are cached now
    for out, ids, ref in zip(chunked.generate(prompts, params, use_tqdm=False), prompts, refs):
        _check_prompt_logprobs(out.prompt_logprobs, ids, ref, 2)
        assert out.num_cached_tokens == 0
    n2 = chunked.generate(prompts[0], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4, prompt_logprobs=0),
                          use_tqdm=False)[0]
    _check_prompt_logprobs(n2.prompt_logprobs, prompts[0], refs[0], 0)

    preempting = LLM(path, num_kv_blocks=24, block_size=4)
    for out, ids, ref in zip(preempting.generate(prompts, params, use_tqdm=False), prompts, refs):
        _check_prompt_logprobs(out.prompt_logprobs, ids, ref, 2)
    scheduler = preempting.llm_engine.core.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.kv_cache_manager.num_free_blocks == 24

    # A DELTA stream carries them once, in its first output.
    engine = chunked.llm_engine
    engine.add_request("delta", prompts[1], dataclasses.replace(params, output_kind=RequestOutputKind.DELTA))
    carried = []
    while engine.has_unfinished_requests():
        carried += [o.prompt_logprobs for o in engine.step() if o.request_id == "delta"]
    assert carried[0] is not None and all(p is None for p in carried[1:])
    _check_prompt_logprobs(carried[0], prompts[1], refs[1], 2)
