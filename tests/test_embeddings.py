"""Embeddings (runner="pooling"): our pooled vectors against transformers' hidden states on the same weights,
whatever the chunking, prefix caching and preemption; the model folder's sentence-transformers settings; the
request options and the errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoinfer import LLM, PoolingParams, SamplingParams
from nanoinfer.pooling_params import PoolerConfig
from tests.conftest import TINY

PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((5, 17, 40, 33, 1))]


def save_embedding_model(path, pooling: str | None = "lasttoken", normalize: bool = True, **overrides) -> str:
    """A tiny random Qwen3 exported as embedding models ship: the bare model (`layers.0...`, no LM head), with
    sentence-transformers' modules.json and pooling settings (none if `pooling` is None)."""
    import transformers

    torch.manual_seed(0)
    transformers.Qwen3Model(transformers.Qwen3Config(**dict(TINY, head_dim=16), **overrides)).save_pretrained(path)
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                    f"pooling_mode_{pooling}": True}))
    return str(path)


@pytest.fixture(scope="module")
def embedding_model(tmp_path_factory) -> str:
    return save_embedding_model(tmp_path_factory.mktemp("embed") / "qwen3-embedding")


def reference(path: str, prompt: list[int], pooling_type: str, normalize: bool = True) -> torch.Tensor:
    import transformers

    model = transformers.AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling_type]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def embed(llm: LLM, prompts, params=None) -> list[torch.Tensor]:
    return [torch.tensor(o.outputs.embedding) for o in llm.embed(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_embeddings_equal_transformers_in_chunks(embedding_model, pooling_type):
    """16 tokens per step: the longer prompts are pooled over 2-3 chunks, beside other prompts' chunks."""
    llm = LLM(embedding_model, runner="pooling", pooler_config={"pooling_type": pooling_type},
              max_num_batched_tokens=16, device="cpu")
    for prompt, vector in zip(PROMPTS, embed(llm, PROMPTS)):
        expected = reference(embedding_model, prompt, pooling_type)
        assert torch.allclose(vector, expected, atol=1e-5), (pooling_type, len(prompt))
        assert math.isclose(vector.norm().item(), 1.0, rel_tol=1e-5)
    assert llm.llm_engine.core.config.enable_prefix_caching == (pooling_type == "LAST")


def test_last_pooling_reads_cached_prefixes_and_survives_preemption(embedding_model):
    """LAST pooling may skip a cached prefix (the last token is always computed); a KV cache of 4 blocks of 16
    tokens forces preemptions; the vectors stay transformers'."""
    llm = LLM(embedding_model, runner="pooling", max_num_batched_tokens=32, num_kv_blocks=4, device="cpu")
    prompts = PROMPTS + [PROMPTS[2] + [9, 8, 7]]  # shares PROMPTS[2]'s first 32 tokens
    first = embed(llm, prompts)
    again = embed(llm, prompts)
    stats = llm.llm_engine.core.stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0
    for prompt, a, b in zip(prompts, first, again):
        expected = reference(embedding_model, prompt, "LAST")
        assert torch.allclose(a, expected, atol=1e-5) and torch.allclose(b, expected, atol=1e-5)
    assert llm.llm_engine.core.scheduler.kv_cache_manager.usage == 0  # every block back


def test_mean_pooling_survives_preemption(embedding_model):
    """A request preempted mid-prompt is pooled again from its first token, not twice over its first chunks."""
    llm = LLM(embedding_model, runner="pooling", pooler_config={"pooling_type": "MEAN"}, max_num_batched_tokens=24,
              num_kv_blocks=4, max_model_len=48, device="cpu")
    for prompt, vector in zip(PROMPTS * 2, embed(llm, PROMPTS * 2)):
        assert torch.allclose(vector, reference(embedding_model, prompt, "MEAN"), atol=1e-5)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0


def test_pooler_settings_come_from_sentence_transformers_files(tmp_path):
    cases = {"lasttoken": ("LAST", True), "mean_tokens": ("MEAN", False), "cls_token": ("CLS", True)}
    for mode, (pooling_type, normalize) in cases.items():
        folder = save_embedding_model(tmp_path / mode, mode, normalize)
        assert PoolerConfig.resolve(folder, None, None) == PoolerConfig(pooling_type, normalize)
    plain = save_embedding_model(tmp_path / "plain", None)
    assert PoolerConfig.resolve(plain, None, None) == PoolerConfig("LAST", True)  # vLLM's default for a decoder
    assert PoolerConfig.resolve(plain, None, {"normalize": False}).normalize is False
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        PoolerConfig.resolve(plain, None, {"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="takes 'pooling_type' and 'normalize'"):
        PoolerConfig.resolve(plain, None, {"softmax": True})
    llm = LLM(str(tmp_path / "mean_tokens"), runner="pooling", device="cpu")  # MEAN, not normalized
    vector = embed(llm, PROMPTS[:1])[0]
    assert torch.allclose(vector, reference(str(tmp_path / "mean_tokens"), PROMPTS[0], "MEAN", False), atol=1e-5)


def test_normalize_and_dimensions_per_request(embedding_model, tmp_path):
    llm = LLM(embedding_model, runner="pooling", device="cpu")
    raw = embed(llm, PROMPTS[:2], PoolingParams(normalize=False))
    for prompt, vector in zip(PROMPTS, raw):
        assert torch.allclose(vector, reference(embedding_model, prompt, "LAST", normalize=False), atol=1e-5)
    with pytest.raises(ValueError, match="dimensions is not supported by this model"):
        llm.embed(PROMPTS[:1], PoolingParams(dimensions=8), use_tqdm=False)
    matryoshka = save_embedding_model(tmp_path / "matryoshka", is_matryoshka=True)
    llm = LLM(matryoshka, runner="pooling", device="cpu")
    short = embed(llm, PROMPTS[:1], PoolingParams(dimensions=8))[0]
    full = reference(matryoshka, PROMPTS[0], "LAST", normalize=False)
    assert short.shape == (8,) and torch.allclose(short, torch.nn.functional.normalize(full[:8], dim=0), atol=1e-5)
    with pytest.raises(ValueError, match=r"dimensions \(65\) is more than the model's 64"):
        llm.embed(PROMPTS[:1], PoolingParams(dimensions=65), use_tqdm=False)
    # A model that names its dimensions gives those only, as vLLM's.
    named = LLM(save_embedding_model(tmp_path / "named", matryoshka_dimensions=[8, 16]), runner="pooling", device="cpu")
    assert embed(named, PROMPTS[:1], PoolingParams(dimensions=16))[0].shape == (16,)
    with pytest.raises(ValueError, match=r"dimensions \(10\) is not one this model was trained to give: \[8, 16\]"):
        named.embed(PROMPTS[:1], PoolingParams(dimensions=10), use_tqdm=False)


def test_bad_embedding_requests_are_clear_errors(embedding_model, tiny_models):
    llm = LLM(embedding_model, runner="pooling", max_model_len=40, device="cpu")
    with pytest.raises(ValueError, match="takes PoolingParams, not SamplingParams"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="takes PoolingParams, not SamplingParams"):
        next(llm.stream(PROMPTS[0]))
    with pytest.raises(ValueError, match="embeddings come from embed"):
        llm.stream(PROMPTS[0], PoolingParams())
    assert len(embed(llm, [PROMPTS[2]])[0]) == 64  # a prompt of max_model_len tokens: nothing follows it
    with pytest.raises(ValueError, match="prompt has 41 tokens; max_model_len allows at most 40"):
        llm.embed([PROMPTS[2] + [1]], use_tqdm=False)
    assert len(embed(llm, [PROMPTS[2] + [1]], PoolingParams(truncate_prompt_tokens=-1))[0]) == 64
    for bad, error in (({"normalize": 1}, TypeError), ({"dimensions": 0}, ValueError),
                       ({"truncate_prompt_tokens": 0}, ValueError)):
        with pytest.raises(error):
            PoolingParams(**bad)
    generator = LLM(tiny_models["qwen3"], device="cpu")
    with pytest.raises(ValueError, match="embeddings need an engine built with runner='pooling'"):
        generator.embed(PROMPTS[:1], use_tqdm=False)
    with pytest.raises(ValueError, match="pooler_config applies to runner='pooling' only"):
        LLM(tiny_models["qwen3"], pooler_config={"pooling_type": "MEAN"}, device="cpu")


def test_a_causal_lm_checkpoint_embeds_too(tiny_models):
    """vLLM's way for a generative checkpoint served as an embedding model: LAST pooling, normalized."""
    import transformers

    llm = LLM(tiny_models["qwen3"], runner="pooling", device="cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], torch_dtype=torch.float32)
    with torch.no_grad():
        hidden = model.model(torch.tensor([PROMPTS[1]])).last_hidden_state[0, -1]
    assert torch.allclose(embed(llm, PROMPTS[1:2])[0], torch.nn.functional.normalize(hidden, dim=0), atol=1e-5)


def test_score_is_the_cosine_of_each_pairs_embeddings(embedding_model):
    llm = LLM(embedding_model, runner="pooling", device="cpu")
    vectors = embed(llm, PROMPTS[:3])
    one_to_many = llm.score(PROMPTS[0], PROMPTS[1:3], use_tqdm=False)
    assert [o.outputs.score for o in one_to_many] == pytest.approx(
        [float(vectors[0] @ vectors[1]), float(vectors[0] @ vectors[2])], abs=1e-6)  # unit vectors: dot = cosine
    pairwise = llm.score(PROMPTS[:2], PROMPTS[1:3], use_tqdm=False)
    assert [o.outputs.score for o in pairwise] == pytest.approx(
        [float(vectors[0] @ vectors[1]), float(vectors[1] @ vectors[2])], abs=1e-6)
    assert llm.score(PROMPTS[1], PROMPTS[1], use_tqdm=False)[0].outputs.score == pytest.approx(1.0, abs=1e-6)
    assert [o.prompt_token_ids for o in one_to_many] == [PROMPTS[0] + PROMPTS[1], PROMPTS[0] + PROMPTS[2]]
    cut = llm.score(PROMPTS[0], PROMPTS[1:3], use_tqdm=False, pooling_params=PoolingParams(truncate_prompt_tokens=2))
    assert [o.prompt_token_ids for o in cut] == [PROMPTS[0][-2:] + PROMPTS[1][-2:], PROMPTS[0][-2:] + PROMPTS[2][-2:]]
    assert [o.prompt_token_ids for o in llm.score(PROMPTS[0], PROMPTS[1:3], use_tqdm=False,
                                                  truncate_prompt_tokens=2)] == [o.prompt_token_ids for o in cut]
    with pytest.raises(ValueError, match="first side of a score request has 2 texts and the second 3"):
        llm.score(PROMPTS[:2], PROMPTS[:3], use_tqdm=False)
    with pytest.raises(ValueError, match="each side of a score request needs at least one text"):  # vLLM's too
        llm.score(PROMPTS[0], [], use_tqdm=False)


def test_embed_and_encode_take_vllms_keywords(embedding_model):
    """vLLM's `embed(..., truncate_prompt_tokens=)` (over every pooling_params) and `encode` (the vectors as
    tensors, `outputs.data`)."""
    llm = LLM(embedding_model, runner="pooling", device="cpu")
    cut = llm.embed(PROMPTS[1:3], [PoolingParams(), PoolingParams(normalize=False)], use_tqdm=False,
                    truncate_prompt_tokens=3)
    assert [o.prompt_token_ids for o in cut] == [PROMPTS[1][-3:], PROMPTS[2][-3:]]
    for got, want in zip(cut, llm.embed([PROMPTS[1][-3:], PROMPTS[2][-3:]],
                                        [PoolingParams(), PoolingParams(normalize=False)], use_tqdm=False)):
        assert got.outputs.embedding == pytest.approx(want.outputs.embedding, abs=1e-5)
    encoded = llm.encode(PROMPTS[:2], use_tqdm=False)
    assert all(isinstance(o.outputs.data, torch.Tensor) for o in encoded)
    for got, want in zip(encoded, llm.embed(PROMPTS[:2], use_tqdm=False)):  # (the second run reads cached prefixes)
        assert torch.allclose(got.outputs.data, torch.tensor(want.outputs.embedding), atol=1e-5)
    assert [o.prompt_token_ids for o in encoded] == PROMPTS[:2]


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4), budget=st.integers(1, 16),
       pooling_type=st.sampled_from(["LAST", "MEAN", "CLS"]))
def test_pooler_gives_the_whole_prompts_vector_whatever_the_chunks(lengths, budget, pooling_type):
    """The runner's pooler alone: prompts prefilled in chunks of a token budget per step (several prompts'
    chunks in one step, as the scheduler packs them) pool to the vector of each whole prompt's hidden states."""
    from types import SimpleNamespace

    from nanoinfer.model_runner.pooler import Pooler

    torch.manual_seed(len(lengths) * 31 + budget)
    hidden = [torch.randn(n, 8) for n in lengths]  # each prompt's final hidden states
    states = [SimpleNamespace(prompt_len=n, num_computed_tokens=0, pooled=None) for n in lengths]
    pooler, got = Pooler(pooling_type), {}
    while len(got) < len(lengths):
        step, room = [], budget  # (prompt, first token, tokens) of this step, FCFS within the budget
        for i, state in enumerate(states):
            if i not in got and room and state.num_computed_tokens < state.prompt_len:
                count = min(room, state.prompt_len - state.num_computed_tokens)
                step.append((i, state.num_computed_tokens, count))
                room -= count
        rows = torch.cat([hidden[i][first:first + count] for i, first, count in step])
        starts = [0]
        for _, _, count in step:
            starts.append(starts[-1] + count)
        finishing = [k for k, (i, first, count) in enumerate(step) if first + count == lengths[i]]
        vectors = pooler(rows, [states[i] for i, _, _ in step], starts, finishing,
                         torch.tensor([starts[k + 1] - 1 for k in finishing], dtype=torch.long))
        for k, vector in zip(finishing, [] if vectors is None else vectors):
            got[step[k][0]] = vector
        for i, first, count in step:
            states[i].num_computed_tokens = first + count
    for i, h in enumerate(hidden):
        expected = {"LAST": h[-1], "MEAN": h.mean(dim=0), "CLS": h[0]}[pooling_type]
        assert torch.allclose(got[i], expected, atol=1e-5)
