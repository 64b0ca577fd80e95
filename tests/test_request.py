"""A request's own rules for a sampled token: which token ends it, with which finish and stop reason."""

from __future__ import annotations

from nanoinfer.request import Request, RequestStatus
from nanoinfer.sampling_params import SamplingParams

EOS = 2


def request(max_tokens: int = 5, **params) -> Request:
    return Request("r", [10, 11, 12], SamplingParams(max_tokens=max_tokens, **params), {EOS}, block_size=4,
                   max_tokens=max_tokens)


def feed(r: Request, tokens: list[int], max_model_len: int = 100) -> list[bool]:
    return [r.append_output_token(t, max_model_len) for t in tokens]


def test_eos_ends_with_no_stop_reason_and_stop_ids_are_reported():
    r = request()
    assert feed(r, [7, EOS]) == [False, True]
    assert (r.status.finish_reason, r.stop_reason, r.output_token_ids) == ("stop", None, [7, EOS])
    r = request(stop_token_ids=[7])
    assert feed(r, [5, 7]) == [False, True] and (r.status.finish_reason, r.stop_reason) == ("stop", 7)


def test_min_tokens_and_ignore_eos_hold_the_stop_back():
    r = request(min_tokens=3)
    assert feed(r, [EOS, EOS, EOS]) == [False, False, True]
    r = request(ignore_eos=True)
    assert feed(r, [EOS] * 5) == [False] * 4 + [True] and r.status == RequestStatus.FINISHED_LENGTH


def test_length_by_max_tokens_or_by_the_context():
    r = request(max_tokens=2)
    assert feed(r, [5, 6]) == [False, True] and r.status.finish_reason == "length" and r.stop_reason is None
    r = request()
    assert feed(r, [5, 6], max_model_len=5) == [False, True] and r.status.finish_reason == "length"


def test_hashes_follow_the_tokens_block_by_block():
    r = request(max_tokens=10)
    assert len(r.block_hashes) == 0  # 3 prompt tokens: no full block of 4
    feed(r, [5])
    assert len(r.block_hashes) == 1
    feed(r, [6, 7, 8])
    assert len(r.block_hashes) == 1
    feed(r, [9])
    assert len(r.block_hashes) == 2
