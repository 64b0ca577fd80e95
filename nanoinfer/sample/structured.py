"""Structured outputs: a grammar (a JSON schema, any JSON object, a regex, a list of choices, an EBNF grammar)
constrains which tokens a request may sample next. xgrammar (vLLM's default backend) compiles the grammar against
the tokenizer's vocabulary and, per request, a matcher follows the tokens sampled so far and fills a bitmask of
the tokens allowed next; the sampler sets every other token's logit to -inf.

A bad grammar is the caller's error, found at admission before anything enters the engine: offline the front end
shares the engine core's compiler, so its check is the compile the core then finds done; the server's API process
only parses the grammar (`parse_grammar`, as vLLM's does: ~10x cheaper than compiling, and no second compile in
the other process), and a grammar that parses but does not compile fails its own request alone at its first
sampling (finish_reason "error"). The core compiles in threads of its own (xgrammar releases the GIL; a wide schema
takes seconds), and the scheduler admits the request only once that is done, so a slow grammar delays its own
request, never the running ones nor (several threads) other grammars. The sampling rank then makes the request's
matcher, fed every sampled token (also those a preemption replays).

With a reasoning parser (and a tokenizer whose think tags are single tokens) the grammar waits while the reply
reasons: its rows go unmasked and its matcher sees only what follows `</think>` (sample/think.py)."""

from __future__ import annotations

import logging
import os
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
import torch

from nanoinfer.sample.lark import is_lark, lark_to_ebnf
from nanoinfer.sample.think import CONTENT, OPENING, REASONING, ThinkTags
from nanoinfer.sampling_params import StructuredOutputsParams

logger = logging.getLogger("nanoinfer")

_COMPILE_THREADS = 4
_THREADED_ROWS = 16  # rows from which matchers are fed and bitmasks filled in threads (H200 host: threads
# cost more than they save at 1-15 rows, and save at 17-64)


class GrammarCache:
    """Grammars made by `make` in threads of its own, several at once (a slow grammar, a wide schema taking
    seconds, holds up no other behind it): once per grammar while it is among the latest 256, or while anything
    still holds its future (a request, from admission to its end: its matcher is made from it at its first
    sampling or after a preemption, without making it again inside a step)."""

    def __init__(self, make: Callable[[StructuredOutputsParams], Any]) -> None:
        self.make = make
        self._thread = ThreadPoolExecutor(max_workers=_COMPILE_THREADS, thread_name_prefix="grammar")
        self._latest: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._held: weakref.WeakValueDictionary[tuple[str, str], Future] = weakref.WeakValueDictionary()

    def get(self, spec: StructuredOutputsParams) -> Future:
        key = spec.key
        future = self._held.get(key)
        if future is None:
            future = self._held[key] = self._thread.submit(self.make, spec)
        self._latest[key] = future
        self._latest.move_to_end(key)
        if len(self._latest) > 256:
            self._latest.popitem(last=False)
        return future


def parse_grammar(spec: StructuredOutputsParams) -> Any:
    """`spec` as an xgrammar Grammar, not yet compiled against a vocabulary (~10x cheaper: a 200-property schema
    parses in ~7 ms and compiles in ~70); ValueError naming what is wrong. What the server's API process checks at
    admission, as vLLM's does: the engine core compiles."""
    import xgrammar

    try:
        any_whitespace = not spec.disable_any_whitespace
        if spec.json is not None:
            return xgrammar.Grammar.from_json_schema(spec.json, any_whitespace=any_whitespace)
        if spec.json_object:
            return (xgrammar.Grammar.builtin_json_grammar() if any_whitespace else
                    xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False))
        if spec.regex is not None:
            return xgrammar.Grammar.from_regex(spec.regex)
        if spec.choice is not None:
            return xgrammar.Grammar.from_regex("|".join(_regex_literal(c) for c in spec.choice))
        if is_lark(spec.grammar):  # vLLM takes Lark's notation too
            ebnf, root = lark_to_ebnf(spec.grammar, lambda pattern: str(xgrammar.Grammar.from_regex(pattern)))
            return xgrammar.Grammar.from_ebnf(ebnf, root_rule_name=root)
        return xgrammar.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError) as e:  # xgrammar reports a bad schema, regex or grammar as RuntimeError
        raise _cannot_compile(spec, e) from None


class GrammarCompiler:
    """xgrammar's compiler for one tokenizer and model vocabulary, built when first needed (~0.2 s)."""

    def __init__(self, tokenizer, vocab_size: int, reasoning_parser: str | None = None) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info)
        self.vocab_size = vocab_size
        self.think = ThinkTags.of(tokenizer, reasoning_parser, vocab_size)  # None: grammars apply from the start
        if reasoning_parser is not None and self.think is None:
            logger.warning("reasoning_parser %s: the tokenizer has no single <think> and </think> tokens, so a "
                           "grammar cannot wait for the reasoning to end: it applies from the first token",
                           reasoning_parser)
        self.grammars = GrammarCache(lambda spec: self.compile(spec))  # (looked up at each compile)
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher, made at the first bitmask
        self._accepting: ThreadPoolExecutor | None = None  # threads that feed sampled tokens to large batches
        # Once a matcher has accepted a stop token only stop tokens may follow (the output is complete): a step
        # planned before the request's end was seen, or a request that ignores eos.
        bits = np.zeros(-(-vocab_size // 32) * 32, dtype=bool)
        bits[info.stop_token_ids] = True
        self.stop_only = torch.from_numpy(np.packbits(bits.reshape(-1, 32)[:, ::-1]).view(">u4").astype(np.uint32)
                                          .view(np.int32))

    def compile_async(self, spec: StructuredOutputsParams) -> Future:
        """The compiled grammar of `spec`, compiled in this compiler's threads (GrammarCache)."""
        return self.grammars.get(spec)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of `spec`; ValueError naming what is wrong."""
        grammar = parse_grammar(spec)
        try:
            return self.compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise _cannot_compile(spec, e) from None

    def request_grammar(self, spec: StructuredOutputsParams, token_ids: list[int], prompt_len: int
                        ) -> "RequestGrammar":
        """A request's grammar, having read the outputs in `token_ids` (a request resumed after preemption)."""
        phase = CONTENT if self.think is None else self.think.first_phase(token_ids[:prompt_len])
        grammar = RequestGrammar(self.xgr.GrammarMatcher(self.compile_async(spec).result()), phase, self.think)
        _accept_all([(grammar, token_id) for token_id in token_ids[prompt_len:]])
        return grammar

    def accept(self, pairs: list[tuple["RequestGrammar", int]]) -> None:
        """Feed each (request's grammar, sampled token). xgrammar releases the GIL while a matcher reads a token
        (~20-40 us for JSON), so a batch of 16 rows or more is split across threads: 256 rows took ~7 ms one after
        another."""
        threads = max(1, (os.cpu_count() or 2) // 2)
        if len(pairs) < _THREADED_ROWS or threads == 1:
            return _accept_all(pairs)
        if self._accepting is None:
            self._accepting = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar-accept")
        list(self._accepting.map(_accept_all, [pairs[i::threads] for i in range(threads)]))

    def bitmask(self, grammars: list["RequestGrammar"]) -> torch.Tensor:
        """[rows, words] int32 on the CPU: row i's allowed next tokens, one bit each (a reasoning row: all). Many
        rows are filled by xgrammar's batch matcher, in threads of its own (256 JSON rows: 9.9 ms one by one,
        1.8 ms so, here)."""
        mask = self.xgr.allocate_token_bitmask(len(grammars), self.vocab_size)  # all bits set
        live = []
        for row, grammar in enumerate(grammars):
            if grammar.phase == REASONING:
                continue
            if grammar.matcher.is_terminated():
                mask[row] = self.stop_only
            else:
                live.append(row)
        if len(live) < _THREADED_ROWS:  # a few rows: starting threads costs more than it saves
            for row in live:
                grammars[row].matcher.fill_next_token_bitmask(mask, row)
        elif live:
            if self._batch is None:
                self._batch = self.xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask([grammars[row].matcher for row in live], mask, indices=live)
        opening = [row for row in live if grammars[row].phase == OPENING]
        if opening:  # the reply's first token may also open a think block
            word, bit = divmod(self.think.start, 32)
            mask[opening, word] |= (1 << bit) if bit < 31 else -(1 << 31)  # bit 31 of an int32 is its sign
        return mask


class RequestGrammar:
    """A request's matcher and the phase of its reply (think.py): the matcher reads only the answer, what follows
    the reasoning; without a reasoning parser that is the whole reply."""

    __slots__ = ("matcher", "phase", "think")

    def __init__(self, matcher: Any, phase: str, think: ThinkTags | None) -> None:
        self.matcher, self.phase, self.think = matcher, phase, think

    def accept(self, token_id: int) -> None:
        if self.phase != CONTENT:
            previous, self.phase = self.phase, self.think.next_phase(self.phase, token_id)
            if not (previous == OPENING and self.phase == CONTENT):  # a tag, or reasoning: not the answer's
                return
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token_id)


def _accept_all(pairs: list[tuple[RequestGrammar, int]]) -> None:
    for grammar, token_id in pairs:
        grammar.accept(token_id)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf for every token whose bit is 0 in `bitmask` (one row per entry of `rows`, the logits rows it masks)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).view(bitmask.shape[0], -1)[:, : logits.shape[1]].bool()
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))


def _regex_literal(text: str) -> str:
    """`text` as a regex matching exactly it (xgrammar's regex syntax: the special characters escaped)."""
    return "".join("\\" + ch if ch in r"\^$.|?*+()[]{}/" else ch for ch in text)


def _cannot_compile(spec: StructuredOutputsParams, error: Exception) -> ValueError:
    return ValueError(f"structured_outputs: the {spec.kind} cannot be compiled: {_first_line(error)}")


def _first_line(error: Exception) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
