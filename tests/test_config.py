"""Engine arguments: defaults that depend on who runs the engine and on which GPU, and the chat template."""

from __future__ import annotations

import dataclasses

from types import SimpleNamespace
from unittest import mock

import pytest

from nanoinfer import EngineConfig
from nanoinfer.engine import llm as llm_module
from nanoinfer.engine.llm import LLM, offline_max_num_batched_tokens

GiB = 2**30


def test_engine_default_token_budget_is_the_servers() -> None:
    assert EngineConfig().max_num_batched_tokens == 8192
    assert EngineConfig(max_num_batched_tokens=100).max_num_batched_tokens == 100
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive integer"):
        EngineConfig(max_num_batched_tokens=0)


@pytest.mark.parametrize("name, memory, expected", [
    ("NVIDIA H200", 141 * GiB, 16384),
    ("NVIDIA H100 80GB HBM3", 80 * GiB, 16384),
    ("NVIDIA A100-SXM4-80GB", 80 * GiB, 8192),  # vLLM measured a larger budget slower there
    ("NVIDIA L4", 24 * GiB, 8192),
])
def test_offline_token_budget_follows_the_gpu(name, memory, expected) -> None:
    props = SimpleNamespace(name=name, total_memory=memory)
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.current_device", return_value=0), \
            mock.patch("torch.cuda.get_device_properties", return_value=props):
        assert offline_max_num_batched_tokens() == expected
        assert offline_max_num_batched_tokens("cpu") == 8192


def test_llm_applies_the_offline_default_unless_given() -> None:
    built = []
    with mock.patch.object(llm_module, "LLMEngine", side_effect=lambda config: built.append(config) or mock.Mock()), \
            mock.patch.object(llm_module, "offline_max_num_batched_tokens", return_value=16384) as default:
        LLM("some-model")
        LLM("some-model", max_num_batched_tokens=None, device="cpu")
        LLM("some-model", max_num_batched_tokens=512)
    assert [c.max_num_batched_tokens for c in built] == [16384, 16384, 512]
    assert [call.args for call in default.call_args_list] == [("auto",), ("cpu",)]


def test_chat_template_from_a_file_or_inline_is_checked_at_once(tmp_path) -> None:
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert EngineConfig(chat_template=str(tmp_path / "t.jinja")).chat_template == template
    assert EngineConfig(chat_template=tmp_path / "t.jinja").chat_template == template
    assert EngineConfig(chat_template=template).chat_template == template
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        EngineConfig(chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="syntax error on line 2"):
        EngineConfig(chat_template="{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    with pytest.raises(TypeError, match="chat_template"):
        EngineConfig(chat_template=3)
    (tmp_path / "plain.txt").write_text("no template here")
    with pytest.raises(ValueError, match="holds no Jinja template"):
        EngineConfig(chat_template=str(tmp_path / "plain.txt"))
    # transformers' own tags (its extensions) pass, and a config copied with replace() keeps its template.
    tagged = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    config = EngineConfig(chat_template=tagged)
    assert dataclasses.replace(config, seed=1).chat_template == tagged


def test_chat_template_replaces_the_tokenizers(tiny_models, smollm2_path) -> None:
    from nanoinfer import LLM

    llm = LLM(tiny_models["llama"], tokenizer=smollm2_path, kv_cache_memory_bytes=16 << 20,
              chat_template="{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    assert llm.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        llm.tokenizer.encode("<<hi>>", add_special_tokens=False)
    with pytest.raises(ValueError, match="chat_template needs a tokenizer"):
        LLM(tiny_models["llama"], kv_cache_memory_bytes=16 << 20, chat_template="{{ messages }}")
