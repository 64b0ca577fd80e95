"""What a launched step hands back: a future for its sampled tokens (read back
only when the caller needs them, so async scheduling can plan the next step
meanwhile), and the conversions of sampler tensors into per-request results."""

from __future__ import annotations

from typing import Any, Callable

import torch

from nanoinfer.model_runner.state import CachedRequestState
from nanoinfer.outputs import ModelRunnerOutput, TokenLogprobs
from nanoinfer.sample.sampler import LogprobsTensors, SamplerOutput


def copy_to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    if tensor.device.type != "cuda":
        return tensor, None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def _rows(tensors: LogprobsTensors, top_n: list[int | None]) -> list[TokenLogprobs | None]:
    """Row i as TokenLogprobs with its top_n[i] alternatives (None: the row asked for no logprobs)."""
    ids, values = tensors.logprob_token_ids.tolist(), tensors.logprobs.tolist()
    ranks = tensors.selected_token_ranks.tolist()
    return [None if n is None else TokenLogprobs(ids[i][0], values[i][0], ranks[i], ids[i][1 : 1 + n],
                                                 values[i][1 : 1 + n]) for i, n in enumerate(top_n)]


def logprobs_to_lists(sampled: SamplerOutput, states: list[CachedRequestState]) -> list[TokenLogprobs | None]:
    if sampled.logprobs is None:
        return [None] * len(states)
    return _rows(sampled.logprobs, [s.sampling_params.logprobs for s in states])


def prompt_logprobs_to_lists(prompt_logprobs: tuple[list[tuple[str, int, int, int]], LogprobsTensors] | None
                             ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    """ModelRunner._prompt_logprobs' result per request: (first position, entries)."""
    if prompt_logprobs is None:
        return {}
    spans, tensors = prompt_logprobs
    entries = _rows(tensors, [n for _, _, count, n in spans for _ in range(count)])
    result, first = {}, 0
    for req_id, start, count, _ in spans:
        result[req_id] = (start, entries[first : first + count])
        first += count
    return result


NO_TOKEN = -1  # the host copy's token id for a row whose masks left nothing to sample (SamplerOutput.no_token)


def stack_rows(rows: list[SamplerOutput | None], device: torch.device) -> SamplerOutput:
    """One batch output from per-row ones. A failed row (None) gets token 0 and
    zero logprobs, which nobody reads: its request ends with an error."""
    zero = torch.zeros(1, dtype=torch.long, device=device)
    token_ids = torch.cat([zero if r is None else r.sampled_token_ids for r in rows])
    no_token = None
    if any(r is not None and r.no_token is not None for r in rows):
        no_token = torch.cat([zero.bool() if r is None or r.no_token is None else r.no_token for r in rows])
    logprobs = [None if r is None else r.logprobs for r in rows]
    if all(lp is None for lp in logprobs):
        return SamplerOutput(token_ids, None, no_token)
    width = max(lp.logprobs.shape[1] for lp in logprobs if lp is not None)

    def column(name: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([torch.zeros(1, width, dtype=dtype, device=device) if lp is None else
                          torch.nn.functional.pad(getattr(lp, name), (0, width - getattr(lp, name).shape[1]))
                          for lp in logprobs])

    ranks = torch.cat([zero if lp is None else lp.selected_token_ranks for lp in logprobs])
    return SamplerOutput(token_ids, LogprobsTensors(column("logprob_token_ids", torch.long),
                                                    column("logprobs", torch.float32), ranks), no_token)


class RunnerFuture:
    """The sampled tokens of one launched step; `result()` waits for them (once), with
    `wait_for_device(event)`: `event.synchronize()` unless the owner sets another (the
    tensor-parallel driver polls, watching its workers)."""

    def __init__(self, states: list[CachedRequestState], sampled: SamplerOutput | None,
                 host_copy: tuple[torch.Tensor, torch.cuda.Event | None] | None,
                 errors: dict[str, str] | None = None, positions: list[int] | None = None,
                 prompt_logprobs: tuple[list[tuple[str, int, int, int]], LogprobsTensors] | None = None,
                 accept: Callable[[list[tuple[Any, int]]], None] | None = None,
                 drafts: list[list[int]] | None = None,
                 pooled: tuple[list[str], tuple[torch.Tensor, torch.cuda.Event | None]] | None = None) -> None:
        """`states`, `positions`: per sampled row; `accept`: feeds (RequestGrammar, token) pairs, the grammar
        compiler's (GrammarCompiler.accept); `drafts`: speculative decoding, each sampled request's draft tokens,
        its rows being its d drafts' positions + 1; `pooled`: runner="pooling", the request ids and the host copy
        of their vectors."""
        self.states, self.sampled, self.host_copy = states, sampled, host_copy
        self.drafts = drafts
        self.pooled = pooled
        self.prompt_logprobs = prompt_logprobs  # on the device until result()
        self.errors = errors or {}
        # Each sampled request's first row (with drafts, a request has a row per draft + 1), and the index of its
        # first new token in its token list.
        self._first_rows = range(len(states)) if drafts is None else _first_rows(drafts)
        positions = positions or []
        self.positions = positions if drafts is None else [positions[r] for r in self._first_rows]
        self.wait_for_device: Callable[[torch.cuda.Event], None] = torch.cuda.Event.synchronize
        self.accept = accept
        self._output: ModelRunnerOutput | None = None

    def done(self) -> bool:
        """Whether `result()` has been read (it is not waited for here)."""
        return self._output is not None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            if not self.states:
                self._output = ModelRunnerOutput([], [], [], {}, prompt_logprobs_to_lists(self.prompt_logprobs),
                                                 self._pooled_lists())
                return self._output
            host, event = self.host_copy
            if event is not None:
                self.wait_for_device(event)
            rows = host.tolist()
            row_logprobs = logprobs_to_lists(self.sampled, self.states)
            if self.drafts is None:  # a token per request
                heads = self.states
                token_ids, logprobs = [[t] for t in rows], [[lp] for lp in row_logprobs]
            else:
                heads = [self.states[r] for r in self._first_rows]
                token_ids, logprobs = self._keep_drafts(rows, row_logprobs)
            grammars = []
            masked = self.sampled.no_token is not None  # (without masks no row can lack a token: nothing to look for)
            for state, new in zip(heads, token_ids):
                if masked and NO_TOKEN in new:  # its masks allowed nothing: the request fails (the scheduler drops it)
                    self.errors[state.req_id] = ("its grammar, allowed_token_ids, bad words or min_tokens allow no "
                                                 "next token")
                    continue
                state.token_ids.extend(new)  # harmless for a request dropped meanwhile
                if state.grammar is not None:  # no drafts: one token
                    grammars.append((state.grammar, new[0]))
            if grammars:
                self.accept(grammars)
            self._output = ModelRunnerOutput([s.req_id for s in heads], token_ids, logprobs, self.errors,
                                             prompt_logprobs_to_lists(self.prompt_logprobs))
        return self._output

    def _keep_drafts(self, rows: list[int], row_logprobs: list[TokenLogprobs | None]
                     ) -> tuple[list[list[int]], list[list[TokenLogprobs | None]]]:
        """Speculative decoding: per request, its drafts up to the first that differs from what its position
        sampled, then that sample (or, all kept, the sample after them): what decoding one by one gives."""
        token_ids, logprobs = [], []
        for first, drafts in zip(self._first_rows, self.drafts):
            kept = 0
            while kept < len(drafts) and rows[first + kept] == drafts[kept]:
                kept += 1
            token_ids.append(rows[first : first + kept + 1])
            logprobs.append(row_logprobs[first : first + kept + 1])
        return token_ids, logprobs

    def _pooled_lists(self) -> dict[str, list[float]]:
        if self.pooled is None:
            return {}
        req_ids, (host, event) = self.pooled
        if event is not None:
            self.wait_for_device(event)
        return dict(zip(req_ids, host.tolist()))


def _first_rows(drafts: list[list[int]]) -> list[int]:
    """Each request's first sampled row, when a request with d drafts samples d + 1 rows."""
    firsts, row = [], 0
    for request_drafts in drafts:
        firsts.append(row)
        row += len(request_drafts) + 1
    return firsts
