"""Per-request sampling parameters, with vLLM's names, defaults and ranges.

Kept free of torch so the server can validate a request before anything
heavy is imported. Every check names the field and the allowed range, since
these errors travel straight back to API clients.
"""

from __future__ import annotations

import copy
import enum
import json
import math
from dataclasses import dataclass

# Below this temperature a request is greedy (argmax); dividing logits by a
# tiny temperature would only overflow.
_SAMPLING_EPS = 1e-5
# Bounds on what one request may ask for every token of every step (OpenAI takes at most 4 stop strings; vLLM
# sets no bound): stop strings are searched in the new text of each token, stop token ids masked per step
# under min_tokens, so an unbounded list from one client would slow every request in the batch.
MAX_STOP_STRINGS = 128
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries, added to every step's logits (OpenAI takes up to 300)
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # more than any vocabulary: the ids are distinct and checked against it at admission
# Nesting of a structured-output JSON schema (objects and lists): xgrammar's compile time grows steeply with it
# (64 levels: 0.06 s; 300: 5 s), and real schemas stay far below.
MAX_SCHEMA_DEPTH = 64
# The 64-bit integers: what torch.Generator.manual_seed accepts, and what the server's wire format (msgpack) carries.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


def child_seed(seed: int, index: int) -> int:
    """The seed of child `index` of an n > 1 request: `seed + index`, wrapped around the seed range."""
    return (seed + index - _SEED_MIN) % (_SEED_MAX - _SEED_MIN + 1) + _SEED_MIN


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def _check_int(name: str, value: object) -> int:
    # bool is an int subclass; True is never a meaningful count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not _SEED_MIN <= value <= _SEED_MAX:
        raise ValueError(f"{name} must fit in 64 bits, in [{_SEED_MIN}, {_SEED_MAX}], got a {value.bit_length()}-bit "
                         f"int")
    return value


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _check_token_ids(name: str, value: object, limit: int, sequence: bool = False) -> list[int]:
    """A list of token ids, at most `limit` of them: a set of ids (duplicates dropped, order kept), or with
    `sequence` a word's tokens in order (a repeated token is part of it)."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of ints, got {type(value).__name__} {value!r:.80}")
    if not set(map(type, value)) <= {int}:  # C loops: a request may carry thousands (allowed_token_ids)
        _check_int(f"{name} entry", next(t for t in value if type(t) is not int))
    if value and min(value) < 0:
        raise ValueError(f"{name} entries must be >= 0, got {min(value)}")
    value = list(value) if sequence else list(dict.fromkeys(value))
    if len(value) > limit:
        raise ValueError(f"{name} holds {len(value)} {'ids' if sequence else 'distinct ids'}, at most {limit} are "
                         f"allowed")
    return value


def _schema_text(schema: object) -> str:
    """A JSON schema (dict or text) as compact JSON text, its nesting bounded (MAX_SCHEMA_DEPTH)."""
    if not isinstance(schema, (dict, str)):
        raise TypeError(f"structured_outputs.json must be a JSON schema (a dict or its text), got {type(schema).__name__}")
    text = schema if isinstance(schema, str) else None
    if text is not None:
        try:
            schema = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    depth, stack = 0, [(schema, 1)]
    while stack:  # iterative: a hostile schema must not exhaust the Python stack
        node, level = stack.pop()
        if isinstance(node, (dict, list)):
            depth = max(depth, level)
            if depth > MAX_SCHEMA_DEPTH:
                raise ValueError(f"structured_outputs.json nests deeper than {MAX_SCHEMA_DEPTH} levels")
            stack.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json must be a JSON object (a schema), got {type(schema).__name__}")
    return text if text is not None else json.dumps(schema)


_GRAMMAR_FIELDS = ("json", "regex", "choice", "grammar")  # StructuredOutputsParams' fields besides json_object


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request holds (vLLM's names)."""

    CUMULATIVE = "cumulative"  # everything so far
    DELTA = "delta"  # only what is new since the request's previous output
    FINAL_ONLY = "final_only"  # one output, when the request finishes


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's names): exactly one of a JSON schema (`json`, a dict or its JSON text;
    kept as text), any JSON object (`json_object=True`), a regex, one of the `choice` strings, or an EBNF
    `grammar`. `disable_any_whitespace`: JSON is written without free whitespace (`", "` and `": "` between
    items), so a model cannot pad it with blanks until max_tokens (small models under a JSON grammar do)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        _check_bool("structured_outputs.json_object", self.json_object)
        _check_bool("structured_outputs.disable_any_whitespace", self.disable_any_whitespace)
        given = [k for k in _GRAMMAR_FIELDS if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of json, json_object, regex, choice and grammar; "
                             f"got {given or 'none'}")
        if self.json is not None:
            self.json = _schema_text(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"structured_outputs.{name} must be a non-empty str, got {value!r:.80}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise TypeError(f"structured_outputs.choice must be a non-empty list of non-empty str, got "
                                f"{self.choice!r:.80}")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return "json_object" if self.json_object else next(k for k in _GRAMMAR_FIELDS if getattr(self, k) is not None)

    @property
    def key(self) -> tuple[str, str]:
        """One grammar, one key (for caching its compilation)."""
        value = "" if self.json_object else getattr(self, self.kind)
        compact = "compact " if self.disable_any_whitespace and self.kind in ("json", "json_object") else ""
        return compact + self.kind, value if isinstance(value, str) else json.dumps(value)  # (choices: unambiguous)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None  # normalised to a list
    stop_token_ids: list[int] | None = None  # normalised to a list
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-n logprobs per generated token
    # Logprobs of the prompt's tokens (each given the tokens before it) plus the top-n at each position; the
    # request then reads no cached prefix, so that every position is computed.
    prompt_logprobs: int | None = None
    # Keep only the prompt's last k tokens (-1: the last max_model_len - 1), as vLLM's: a long document cut to fit.
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    # vLLM's: False leaves the output as token ids (text "", logprobs without decoded_token), skipping the
    # detokenizer's work; stop strings need the text, so they are refused then.
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100] added to its logit each step
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled (the rest masked every step)
    # vLLM's: words never generated (each as the model would spell it at the start of the text and after a space):
    # a word's last token is masked whenever the output ends with the rest of it.
    bad_words: list[str] | None = None
    # The bad words as token ids: set at admission from bad_words (or given directly).
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow (or its dict)
    # What each of the request's outputs holds (LLMEngine.add_request; LLM.generate sets FINAL_ONLY, LLM.stream DELTA).
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r:.80}")
        if _check_int("n", self.n) < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if _check_int("top_k", self.top_k) < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive int, got {self.top_k}")
        self.top_k = max(self.top_k, 0)
        self.min_p = _check_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not (type(self.seed) is int and self.seed == -1):  # -1: unseeded, as vLLM's
            _check_int("seed", self.seed)
        self.seed = None if self.seed == -1 else self.seed
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        self.stop = self._normalise_strings("stop", self.stop)
        if self.bad_words is not None:
            self.bad_words = self._normalise_strings("bad_words", self.bad_words)
        if self.bad_words_token_ids is not None:
            if not isinstance(self.bad_words_token_ids, (list, tuple)) or len(self.bad_words_token_ids) > 2 * MAX_STOP_STRINGS:
                raise ValueError(f"bad_words_token_ids must be a list of at most {2 * MAX_STOP_STRINGS} token id lists")
            self.bad_words_token_ids = [_check_token_ids("bad_words_token_ids entry", ids, MAX_STOP_TOKEN_IDS, True)
                                        for ids in self.bad_words_token_ids]
            if not all(self.bad_words_token_ids):
                raise ValueError("bad_words_token_ids entries must be non-empty")
        self.stop_token_ids = ([] if self.stop_token_ids is None
                               else _check_token_ids("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS))
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "detokenize"):
            _check_bool(name, getattr(self, name))
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are matched in the output text: they need detokenize=True (stop_token_ids "
                             "work without it)")
        if self.max_tokens is not None and _check_int("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if _check_int("min_tokens", self.min_tokens) < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if isinstance(value, bool):  # vLLM's reading: True is 1, False 0 (the chosen token's logprob only)
                value = int(value)
                setattr(self, name, value)
            if value is not None and _check_int(name, value) < -1:  # the engine's max_logprobs bounds it at admission
                raise ValueError(f"{name} must be >= 0, -1 (the whole vocabulary) or None, got {value}")
        keep = self.truncate_prompt_tokens
        if keep is not None and _check_int("truncate_prompt_tokens", keep) < 1 and keep != -1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1, -1 (max_model_len) or None, got "
                             f"{self.truncate_prompt_tokens}")
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _check_token_ids("allowed_token_ids", self.allowed_token_ids, MAX_ALLOWED_TOKEN_IDS)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids is empty: nothing could be sampled")
        if isinstance(self.structured_outputs, dict):  # as it crosses the wire, or from a caller
            unknown = set(self.structured_outputs) - set(StructuredOutputsParams.__dataclass_fields__)
            if unknown:
                raise ValueError(f"structured_outputs has unknown fields {sorted(unknown)}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise TypeError(f"structured_outputs must be StructuredOutputsParams, got "
                            f"{type(self.structured_outputs).__name__}")
        if self.structured_outputs is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with structured_outputs: the grammar decides where the "
                             "output ends")

    @staticmethod
    def _normalise_logit_bias(bias: object) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__} {bias!r:.80}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias holds {len(bias)} entries, at most {MAX_LOGIT_BIAS} are allowed")
        checked = {}
        for token_id, value in bias.items():
            if _check_int("logit_bias key", token_id) < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token_id}")
            if not -100 <= _check_float("logit_bias value", value) <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {token_id}")
            checked[token_id] = float(value)
        return checked or None

    @staticmethod
    def _normalise_strings(name: str, value: object) -> list[str]:
        """`stop` or `bad_words`: a str or a list of non-empty str, at most MAX_STOP_STRINGS of them."""
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a str or a list of str, got {type(value).__name__} {value!r:.80}")
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"{name} holds {len(value)} strings, at most {MAX_STOP_STRINGS} are allowed")
        for s in value:
            if not isinstance(s, str):
                raise TypeError(f"{name} entries must be str, got {type(s).__name__} {s!r:.80}")
            if not s:
                raise ValueError(f"{name} entries must be non-empty strings")
        return list(value)

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's), to change for another request without touching this one."""
        return copy.deepcopy(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling reads the request's token counts (repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
