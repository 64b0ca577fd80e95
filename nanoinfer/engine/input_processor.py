"""Front-end admission: validates and tokenizes a request, fans `n > 1` out
into child requests, and rejects what the engine could never serve — all
before anything enters the engine core, so bad input never touches other
requests."""

from __future__ import annotations

import dataclasses
import inspect
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from nanoinfer.config import check_chat_template
from nanoinfer.inputs import PromptType, content_text
from nanoinfer.lora.adapter import LoRARegistry
from nanoinfer.lora.request import LoRARequest
from nanoinfer.pooling_params import PoolerConfig, PoolingParams
from nanoinfer.request import Request
from nanoinfer.sample.structured import GrammarCache, GrammarCompiler, parse_grammar
from nanoinfer.sampling_params import SamplingParams, StructuredOutputsParams, child_seed


# apply_chat_template's own arguments (and the conversation's name inside templates): chat_template_kwargs holds
# variables for the template, never another template or another way of rendering it.
_RENDER_ARGUMENTS = {*inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters, "messages"} - {"kwargs"}


_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def unpack_prompt(prompt: PromptType) -> tuple[str | list[int], str | None, str | None]:
    """(what to tokenize: text or token ids, the text the outputs report, cache_salt) of a prompt in any form."""
    if not isinstance(prompt, Mapping):
        return prompt, prompt if isinstance(prompt, str) else None, None
    unknown = sorted(set(prompt) - {*_PROMPT_KEYS, "cache_salt"})
    if not any(key in prompt for key in _PROMPT_KEYS) or unknown:
        raise ValueError(f"a dict prompt takes 'prompt' (text) or 'prompt_token_ids' (with the text they stand for "
                         f"as 'prompt', if you like), and optionally 'cache_salt'; got keys {sorted(prompt)}")
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"a dict prompt's 'prompt' must be a str, got {type(text).__name__}")
    if "prompt_token_ids" not in prompt:
        return text, text, prompt.get("cache_salt")
    ids = prompt["prompt_token_ids"]
    if not isinstance(ids, (list, tuple)):  # (a str here would be tokenized as text)
        raise TypeError(f"a dict prompt's 'prompt_token_ids' must be a list of ints, got {type(ids).__name__}")
    return ids, text, prompt.get("cache_salt")


def _template_message(message: dict) -> dict:
    """A message as chat templates expect it (and vLLM passes it): no content is "", and an earlier tool call's
    arguments, JSON text in OpenAI's API, are an object (templates write them with `tojson`)."""
    message = {**message, "content": message.get("content") or ""}
    if message.get("tool_calls"):
        message["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _json_or_text(c["function"].get(
            "arguments", {}))}} if _is_call(c) else c for c in message["tool_calls"]]
    return message


def _is_call(call: object) -> bool:
    """A tool call with a function to render (the template gets anything else as it was given)."""
    return isinstance(call, dict) and isinstance(call.get("function"), dict)


def _json_or_text(arguments: object) -> object:
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):  # not JSON, or nested too deeply for the json module: kept as text
        return arguments


def _call_texts(message: dict) -> list[str]:
    """The text of a message's tool calls (names and arguments given as text), to bound its rendered size."""
    return [text for c in message.get("tool_calls") or () if _is_call(c)
            for text in (c["function"].get("name"), c["function"].get("arguments")) if isinstance(text, str)]


@dataclass
class Admitted:
    """One prompt, admitted: the text it stands for (None for token ids), its token ids and its requests (n > 1:
    one child each)."""

    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]


@dataclass
class EngineLimits:
    """What admission checks need to know about the core."""

    max_model_len: int
    max_tokens_per_request: int  # also bounded by the whole KV cache
    block_size: int
    vocab_size: int
    eos_token_ids: set[int]
    max_logprobs: int  # the engine's, resolved: never more than the vocabulary
    max_num_waiting: int | None = None
    priority_scheduling: bool = False  # scheduling_policy="priority": a request's priority orders the queue

    def check_waiting_room(self, num_waiting: int, num_new: int) -> None:
        """The bounded waiting queue: refuse (OverflowError; the server answers 503) when full, and a request
        that could never fit (ValueError; 400) at once."""
        if self.max_num_waiting is None:
            return
        if num_new > self.max_num_waiting:
            raise ValueError(f"the request needs {num_new} places in the waiting queue (n or beams x prompts), which holds "
                             f"at most {self.max_num_waiting}")
        if num_waiting + num_new > self.max_num_waiting:
            raise OverflowError(f"the waiting queue is full ({num_waiting} requests waiting, "
                                f"at most {self.max_num_waiting})")


class InputProcessor:
    def __init__(self, tokenizer, limits: EngineLimits,
                 grammar_compiler: Callable[[], GrammarCompiler] | None = None,
                 pooler: PoolerConfig | None = None, hidden_size: int = 0,
                 loras: LoRARegistry | None = None) -> None:
        """`grammar_compiler`: the engine core's, where the core runs in this process (a grammar checked here is
        then compiled for the core too); otherwise a grammar is only parsed here (structured.py).
        `pooler`: the engine makes embeddings (runner="pooling") of `hidden_size` values.
        `loras`: the adapters requests may name (enable_lora), or None."""
        self.tokenizer = tokenizer
        self.loras = loras
        self.limits = limits
        self.pooler, self.hidden_size = pooler, hidden_size
        self.grammar_compiler = grammar_compiler
        # No token of the vocabulary spells more characters than its own (byte-level or sentencepiece) string,
        # so text longer than this cannot fit in max_model_len tokens: refused before the tokenizer spends
        # seconds on it (4 MB of text: ~5 s, on the server's event loop).
        self.max_prompt_chars = None if tokenizer is None else limits.max_model_len * max(
            map(len, tokenizer.get_vocab()), default=1)
        self.parsed: GrammarCache | None = None

    def check_prompt_chars(self, num_chars: int) -> None:
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise ValueError(f"prompt is {num_chars} characters long: more than max_model_len "
                             f"({self.limits.max_model_len}) tokens can hold with this tokenizer "
                             f"(at most {self.max_prompt_chars} characters)")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None, chat_template: str | None = None) -> dict:
        """A conversation through the chat template, as a prompt: {"prompt": the rendered text, "prompt_token_ids":
        its tokens} (the text tokenized without special tokens of the tokenizer's own: the template wrote them, as
        transformers does). `tools`: the functions (OpenAI's {"type": "function", "function": {...}}) the template
        tells the model it may call; `template_kwargs`: more variables for the template (vLLM's
        chat_template_kwargs, e.g. Qwen3's enable_thinking); `chat_template`: a Jinja template (text) in place of
        the model's. ValueError when there is no template, the text cannot fit in max_model_len, or the template
        refuses the conversation."""
        if chat_template is not None:
            chat_template = check_chat_template(chat_template)
        if self.tokenizer is None or not (chat_template or getattr(self.tokenizer, "chat_template", None)):
            raise ValueError("this model has no chat template")
        reserved = sorted(set(template_kwargs or ()) & _RENDER_ARGUMENTS)
        if reserved:  # the template's variables only: not the template itself, nor how it is rendered
            raise ValueError(f"chat_template_kwargs may not set {reserved}")
        # Each message costs at least one token, and text its characters over the longest token's: a conversation
        # that cannot fit is refused before the template renders it (on the server's event loop).
        if len(messages) > self.limits.max_model_len:
            raise ValueError(f"{len(messages)} messages cannot fit in max_model_len ({self.limits.max_model_len}) "
                             f"tokens")
        messages = [{**m, "content": content_text(m.get("content"))} for m in messages]
        self.check_prompt_chars(sum(len(m["content"] or "") + sum(map(len, _call_texts(m))) for m in messages)
                                + (len(json.dumps(tools)) if tools else 0))
        messages = [_template_message(m) for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False, chat_template=chat_template,
                **(template_kwargs or {}))
        except Exception as e:  # jinja and transformers raise many types for a conversation they reject
            raise ValueError(f"the chat template rejected the messages: {e}") from None
        self.check_prompt_chars(len(text))  # a template may write far more than the messages hold
        return {"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True, truncated: bool = False
                 ) -> list[int]:
        """`truncated`: only the prompt's last tokens are kept (truncate_prompt_tokens), so text of any length
        may come."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids, or give tokenizer=PATH")
            if not truncated:
                self.check_prompt_chars(len(prompt))
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"the prompt is not valid Unicode text: {e}") from None
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        elif isinstance(prompt, (list, tuple)) and set(map(type, prompt)) <= {int}:  # C loops: no bools, no floats
            token_ids = list(prompt)
        elif isinstance(prompt, (list, tuple)):
            bad = next(t for t in prompt if type(t) is not int)
            raise TypeError(f"token ids must be Python ints, got {type(bad).__name__} {bad!r}")
        else:
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt is empty")
        if min(token_ids) < 0 or max(token_ids) >= self.limits.vocab_size:
            bad = next(t for t in token_ids if not 0 <= t < self.limits.vocab_size)
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.limits.vocab_size})")
        return token_ids

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                priority: int = 0, cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> Admitted:
        """The prompt's token ids and the request(s) to add to the core (n children when n > 1; an embedding's
        one, which computes its prompt and nothing more). With truncate_prompt_tokens the prompt keeps its last
        tokens, and its text becomes theirs. `cache_salt`: also a dict prompt's key, but not both.
        `lora_request`: the adapter it runs with (None: the base model)."""
        prompt, text, salt = unpack_prompt(prompt)
        if salt is not None:
            if cache_salt is not None:
                raise ValueError("cache_salt is given twice: in the prompt dict and as an argument")
            cache_salt = salt
        pooling = isinstance(params, PoolingParams)
        if not (pooling or isinstance(params, SamplingParams)):
            raise TypeError(f"params must be SamplingParams (or PoolingParams: embeddings), got "
                            f"{type(params).__name__}")
        if pooling != (self.pooler is not None):
            raise ValueError("this engine makes embeddings (runner='pooling'): it takes PoolingParams, not "
                             "SamplingParams" if self.pooler else "embeddings need an engine built with "
                             "runner='pooling'")
        if pooling:
            self.pooler.check(params, self.hidden_size)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an integer, got {priority!r}")
        if not -(2**63) <= priority < 2**63:
            raise ValueError(f"priority must fit in 64 bits, got {priority}")
        if priority and not self.limits.priority_scheduling:  # as vLLM: a priority that would do nothing is an error
            raise ValueError(f"priority {priority} needs scheduling_policy='priority' (the server's --scheduling-policy "
                             f"priority); this engine runs requests first come, first served")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
        if cache_salt is not None and not cache_salt.isascii():  # the block hashes take its UTF-8 bytes, in a step
            try:
                cache_salt.encode()
            except UnicodeEncodeError as exc:
                raise ValueError(f"cache_salt must be valid Unicode text: {exc.reason} at {exc.start}") from None
        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise TypeError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
            if self.loras is None:
                raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: this engine serves no adapters (start it "
                                 f"with enable_lora=True, the server with --enable-lora)")
            self.loras.check(lora_request)
        if not pooling:
            params = self._check_sampling(params)
        keep = params.truncate_prompt_tokens
        token_ids = self.tokenize(prompt, truncated=keep is not None)
        if keep is not None:
            if keep > self.limits.max_model_len:
                raise ValueError(f"truncate_prompt_tokens ({keep}) is more than max_model_len "
                                 f"({self.limits.max_model_len})")
            # -1: as many as a request may hold (max_model_len, or the KV cache's tokens when it holds fewer)
            keep = self.limits.max_tokens_per_request - (0 if pooling else 1) if keep == -1 else keep
            if len(token_ids) > keep:
                token_ids = token_ids[-keep:]
                text = None if text is None or self.tokenizer is None else self.tokenizer.decode(token_ids)
        max_tokens = self.check_length(len(token_ids), 0 if pooling else params.max_tokens)
        arrival = time.monotonic()
        if pooling:  # one step past its prompt it has its vector: the core counts that step as a token's
            return Admitted(text, token_ids, [Request(request_id, token_ids, SamplingParams(max_tokens=1),
                                                      self.limits.eos_token_ids, self.limits.block_size, 1, priority,
                                                      cache_salt, arrival)])
        children = []
        for i in range(params.n):
            child_params = dataclasses.replace(params, n=1, seed=None if params.seed is None else child_seed(params.seed, i))
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(Request(child_id, token_ids, child_params, self.limits.eos_token_ids,
                                    self.limits.block_size, max_tokens, priority, cache_salt, arrival, lora_request))
        return Admitted(text, token_ids, children)

    def _check_sampling(self, params: SamplingParams) -> SamplingParams:
        """Token ids the vocabulary must hold, grammars that must compile; bad words spelled as token ids."""
        if params.stop and self.tokenizer is None:  # stop strings are found in the detokenized text
            raise ValueError("stop strings need a tokenizer: this model has none (give tokenizer=PATH, or use "
                             "stop_token_ids)")
        if params.bad_words:
            params = dataclasses.replace(params, bad_words_token_ids=(params.bad_words_token_ids or [])
                                         + self._bad_words_token_ids(params.bad_words))
        for name, token_ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                                ("allowed_token_ids", params.allowed_token_ids or ()),
                                ("bad_words_token_ids", [t for ids in params.bad_words_token_ids or () for t in ids])):
            bad = [t for t in token_ids if t >= self.limits.vocab_size]
            if bad:
                raise ValueError(f"{name} entry {bad[0]} is outside the vocabulary [0, {self.limits.vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value == -1:  # the whole vocabulary
                value = self.limits.vocab_size
                params = dataclasses.replace(params, **{name: value})
            if value is not None and value > self.limits.max_logprobs:
                raise ValueError(f"{name} must be at most {self.limits.max_logprobs} (the engine's max_logprobs), "
                                 f"got {value}{' (-1: the vocabulary)' if value == self.limits.vocab_size else ''}")
        if params.structured_outputs is not None:
            self.check_grammar(params.structured_outputs)
        return params

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as the model spells it at the start of a text, and as it spells it after a space where
        that is as many other tokens (vLLM's reading: "word" and " word" are different tokens in most vocabularies)."""
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer: this model has none (give tokenizer=PATH, or "
                             "bad_words_token_ids)")
        spellings = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                raise ValueError(f"bad_words entry {word!r:.40} is blank")
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            spellings += [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
        return spellings

    def check_grammar(self, spec: StructuredOutputsParams) -> None:
        """A schema, regex or grammar that cannot compile is the caller's error (ValueError), found before the
        request enters the engine."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer: this model has none (give tokenizer=PATH)")
        self.grammar_checks().get(spec).result()

    def grammar_checks(self) -> GrammarCache:
        """Where a grammar is checked: the core's compiled grammars, or this process's parsed ones."""
        if self.grammar_compiler is not None:
            return self.grammar_compiler().grammars
        if self.parsed is None:
            self.parsed = GrammarCache(parse_grammar)
        return self.parsed

    def check_length(self, prompt_len: int, max_tokens: int | None) -> int:
        """The request's max_tokens once the prompt and it are known to fit the context (ValueError otherwise):
        as given, or what the context leaves when None (0: an embedding's prompt alone)."""
        limit = self.limits.max_tokens_per_request
        why = "max_model_len" if limit == self.limits.max_model_len else "the KV cache size"
        if max_tokens is None:
            if prompt_len >= limit:
                raise ValueError(f"prompt has {prompt_len} tokens; {why} allows at most {limit - 1}")
            return limit - prompt_len
        if max_tokens == 0 and prompt_len > limit:  # an embedding's: its prompt alone
            raise ValueError(f"prompt has {prompt_len} tokens; {why} allows at most {limit}")
        if prompt_len + max_tokens > limit:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} "
                             f"exceeds {why} ({limit})")
        return max_tokens
