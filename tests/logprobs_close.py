"""Logprobs of one completion compared with another's computed in a different batch: a CPU matmul may
round a row by its place in the batch (seen: 5e-7, and 1e-5 at a logprob of -11.5), so values are
equal up to float32 noise while the tokens must be the same."""

from __future__ import annotations

import dataclasses

import pytest

from nanoinfer import Logprob


def approx_logprobs(logprobs: list[dict[int, Logprob]] | None) -> list[dict] | None:
    """`assert out.logprobs == approx_logprobs(ref.logprobs)`: ranks and token texts equal, values close."""
    if logprobs is None:
        return None
    return [{token: dataclasses.replace(value, logprob=pytest.approx(value.logprob, rel=1e-4, abs=1e-5))
             for token, value in d.items()} for d in logprobs]
