"""Per-step sampling tensors, built once from the batch's per-row parameters.

The sampler works on whole-batch tensors, one pass per operation. To keep a
152k-entry vocabulary cheap, every optional operation is represented by
`None` when no row in the batch uses it, so the sampler can skip it (no sort
without top-k/top-p, no count tensors without penalties, no log_softmax
without logprobs).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch

from nanoinfer.host_copy import to_device
from nanoinfer.sample.penalties import PenaltyState
from nanoinfer.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    vocab_size: int
    all_greedy: bool
    all_random: bool
    # [B] bool, only for a batch mixing greedy and random rows.
    is_greedy: torch.Tensor | None
    # [B] float32; 1.0 on greedy rows so the division is harmless.
    temperature: torch.Tensor
    # [B] int64; vocab_size on rows without top-k (keeps everything).
    top_k: torch.Tensor | None
    # Largest top-k of the rows that use it: the top-k-only path needs no full sort.
    max_top_k: int
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    # Seeded random rows own their generator; the others share the global one.
    generators: dict[int, torch.Generator]
    # (rows, token ids) forced to -inf: stop tokens of rows below min_tokens, and what the rows' bad words ban.
    banned_tokens: tuple[torch.Tensor, torch.Tensor] | None
    # (rows, token ids, float32 biases) added to the logits: the rows' logit_bias.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # (rows, [rows, vocab] bool: True where sampling is allowed): the rows' allowed_token_ids.
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor] | None
    # The penalized (rows, their slots of `penalty_state`): penalties read those rows' token counts, and the
    # sampler counts what the rows sample into them.
    penalty_state: PenaltyState | None
    counted: tuple[torch.Tensor, torch.Tensor] | None
    repetition_penalties: torch.Tensor | None  # [B] float32
    presence_penalties: torch.Tensor | None  # [B] float32
    frequency_penalties: torch.Tensor | None  # [B] float32
    # Top-n logprobs to return: the largest n asked for in the batch.
    max_num_logprobs: int | None
    # (rows, [rows, words] int32 bitmask): the tokens a structured-output row may sample next, one bit each.
    allowed_tokens: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        num_output_tokens: list[int],
        generators: list[torch.Generator | None],
        stop_token_ids: list[set[int]],
        vocab_size: int,
        device: torch.device,
        allowed_tokens: tuple[list[int], torch.Tensor] | None = None,  # (rows, CPU bitmask): structured outputs
        penalties: tuple[PenaltyState, list[int | None]] | None = None,  # the state, each row's slot (or None)
        bad_word_ids: list[set[int]] | None = None,  # per row, the token ids its bad words ban this step
        allowed_masks: list[torch.Tensor | None] | None = None,  # per row, its allowed_token_mask if the caller keeps it
    ) -> SamplingMetadata:
        """`num_output_tokens`: how many tokens each row's request has generated (min_tokens reads it)."""
        num_rows = len(params)
        if num_rows == 0:
            raise ValueError("SamplingMetadata.build needs at least one row")
        for name, rows in (
            ("num_output_tokens", num_output_tokens),
            ("generators", generators),
            ("stop_token_ids", stop_token_ids),
        ):
            if len(rows) != num_rows:
                raise ValueError(f"{name} has {len(rows)} rows but params has {num_rows}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")

        greedy = [p.is_greedy for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)

        def floats(values: list[float]) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=torch.float32), device)

        def used(values: list[float], neutral: float) -> torch.Tensor | None:
            return None if all(v == neutral for v in values) else floats(values)

        # Greedy rows ignore the filters, so they never force a sort.
        top_ks = [vocab_size if g or p.top_k == 0 else min(p.top_k, vocab_size) for p, g in zip(params, greedy)]
        active_top_ks = [k for k in top_ks if k < vocab_size]
        top_ps = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_ps = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        rep = [p.repetition_penalty for p in params]
        presence = [p.presence_penalty for p in params]
        frequency = [p.frequency_penalty for p in params]
        state, slots = penalties if penalties is not None else (None, [None] * num_rows)
        if any(p.uses_penalties for p in params) and (state is None or len(slots) != num_rows or any(
                slot is None for slot, p in zip(slots, params) if p.uses_penalties)):
            raise ValueError("rows with penalties need a slot of a PenaltyState (penalties=(state, slots))")
        counted = [(i, slot) for i, slot in enumerate(slots) if slot is not None]

        def indexes(values: list[int]) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=torch.int64), device)

        return cls(
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            is_greedy=None if all_greedy or all_random else to_device(torch.tensor(greedy), device),
            temperature=floats([1.0 if g else p.temperature for p, g in zip(params, greedy)]),
            top_k=to_device(torch.tensor(top_ks, dtype=torch.int64), device) if active_top_ks else None,
            max_top_k=max(active_top_ks, default=0),
            top_p=used(top_ps, 1.0),
            min_p=used(min_ps, 0.0),
            generators={i: gen for i, (gen, g) in enumerate(zip(generators, greedy)) if gen is not None and not g},
            banned_tokens=_banned_tokens(params, num_output_tokens, stop_token_ids, bad_word_ids, vocab_size, device),
            logit_bias=_logit_bias(params, vocab_size, device),
            allowed_token_ids=_allowed_token_ids(params, allowed_masks, vocab_size, device),
            penalty_state=state if counted else None,
            counted=(indexes([i for i, _ in counted]), indexes([slot for _, slot in counted])) if counted else None,
            repetition_penalties=used(rep, 1.0),
            presence_penalties=used(presence, 0.0),
            frequency_penalties=used(frequency, 0.0),
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
            allowed_tokens=None if allowed_tokens is None else (
                to_device(torch.tensor(allowed_tokens[0], dtype=torch.int64), device),
                to_device(allowed_tokens[1], device)),
        )


def _banned_tokens(
    params: list[SamplingParams],
    num_output_tokens: list[int],
    stop_token_ids: list[set[int]],
    bad_word_ids: list[set[int]] | None,
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, cols) of the tokens forced to -inf: the stop tokens of the rows below their min_tokens (a row can
    hold up to MAX_STOP_TOKEN_IDS ids plus the end-of-sequence ones, every step it is under min_tokens), and the
    tokens the rows' bad words ban."""
    masked = []
    for i, (p, generated, stops) in enumerate(zip(params, num_output_tokens, stop_token_ids)):
        ids = stops if generated < p.min_tokens else set()
        if bad_word_ids is not None and bad_word_ids[i]:
            ids = ids | bad_word_ids[i]
        if ids:
            masked.append((i, ids))
    if not masked:
        return None
    rows, cols = _row_token_ids(masked, vocab_size, "banned token id")
    return to_device(torch.from_numpy(rows), device), to_device(torch.from_numpy(cols), device)


def _logit_bias(params: list[SamplingParams], vocab_size: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    biased = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
    if not biased:
        return None
    rows, cols = _row_token_ids(biased, vocab_size, "logit_bias token id")
    values = np.concatenate([np.fromiter(bias.values(), np.float32, len(bias)) for _, bias in biased])
    return tuple(to_device(torch.from_numpy(a), device) for a in (rows, cols, values))


def _allowed_token_ids(params: list[SamplingParams], masks: list[torch.Tensor | None] | None, vocab_size: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    limited = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not limited:
        return None
    rows = [masks[i] if masks is not None and masks[i] is not None else
            allowed_token_mask(params[i].allowed_token_ids, vocab_size, device) for i in limited]
    return to_device(torch.tensor(limited, dtype=torch.int64), device), torch.stack(rows)


def allowed_token_mask(token_ids: list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[vocab_size] bool, True at `token_ids`: a request's allowed_token_ids, made once (the model runner keeps it
    for the request's life: a batch of them restacks rows on the device instead of copying ~150 KB each again)."""
    _, cols = _row_token_ids([(0, token_ids)], vocab_size, "allowed_token_ids entry")
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask[to_device(torch.from_numpy(cols), device)] = True
    return mask


def _row_token_ids(per_row: list[tuple[int, Collection[int]]], vocab_size: int,
                   what: str) -> tuple[np.ndarray, np.ndarray]:
    """(rows, token ids) as int64 arrays, flattened from (row, its token ids) pairs with C loops (a row may hold
    over a thousand ids, every step), checked against the vocabulary."""
    rows = np.repeat([i for i, _ in per_row], [len(ids) for _, ids in per_row]).astype(np.int64)
    cols = np.concatenate([np.fromiter(ids, np.int64, len(ids)) for _, ids in per_row])
    if cols.min() < 0 or cols.max() >= vocab_size:
        bad = int(cols[(cols < 0) | (cols >= vocab_size)][0])
        raise ValueError(f"{what} {bad} is outside the vocabulary [0, {vocab_size})")
    return rows, cols
