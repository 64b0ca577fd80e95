"""Request bodies of the HTTP API (OpenAI / vLLM field names) and the
OpenAI-style error every failure is reported as."""

from __future__ import annotations

import functools
import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, StringConstraints, ValidationError, model_validator

from nanoinfer.engine.beam_search import BeamSearchParams
from nanoinfer.inputs import content_text
from nanoinfer.pooling_params import PoolingParams
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.server.tool_calls import (TOOL_CALL_PARSERS, NamedToolCall, RequiredToolCalls, ToolCallExtractor,
                                         parameters_schema, required_schema)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable_error"}


class ApiError(Exception):
    """An error the client gets as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    def body(self) -> dict:
        error_type = _ERROR_TYPES.get(self.status, "internal_server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": error_type, "param": self.param, "code": self.status}}


class _Body(BaseModel):
    # Unknown fields are ignored, as vLLM and OpenAI do. Known ones must have the type the schema says (as
    # OpenAI checks): no "5" or true for an integer (the API fuzzer's negative cases); an int is a float.
    model_config = ConfigDict(extra="ignore", strict=True)
    _null_means_none: ClassVar[frozenset[str]] = frozenset()  # fields where null is a value, not "unset"

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: object) -> object:
        """An explicit null means the field's default, as in OpenAI's schema (clients send unset fields so)."""
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items() if value is not None or key in cls._null_means_none}


class StreamOptions(_Body):
    # As vLLM's: stream_options given at all asks for usage unless include_usage is false.
    include_usage: bool = True
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage


_GUIDED_FIELDS = ("json", "regex", "choice", "grammar")  # guided_<name>: vLLM's older structured_outputs fields

# Fields passed to SamplingParams under the same name when given.
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                    "include_stop_str_in_output", "skip_special_tokens", "prompt_logprobs", "truncate_prompt_tokens",
                    "allowed_token_ids", "bad_words")


# What a beam search request may not set: it takes each step's candidates by their logprobs alone.
_NOT_IN_BEAM_SEARCH = (set(_SAMPLING_FIELDS) - {"n", "temperature", "ignore_eos", "skip_special_tokens"}) | {
    "logit_bias", "response_format", "structured_outputs", *(f"guided_{n}" for n in _GUIDED_FIELDS), "logprobs",
    "top_logprobs", "echo", "tools", "suffix"}


class GenerationRequest(_Body):
    """What both generation endpoints accept besides their prompt."""

    model: str | None = None
    request_id: str | None = None  # vLLM's: names the response ("cmpl-" or "chatcmpl-" + it); X-Request-Id wins
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs (+ top-n), in a whole response only
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    bad_words: list[str] | None = None  # vLLM's: words never generated
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    cache_salt: str | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # JSON keys: token ids as strings
    # OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema"}}, or vLLM's
    # structured_outputs {"json" | "json_object" | "regex" | "choice" | "grammar": ...}: the output follows it.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    # vLLM's names before structured_outputs (still sent by many clients): each is that field of structured_outputs.
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    use_beam_search: bool = False  # vLLM's: n beams (beam_search_params)
    length_penalty: float = 1.0
    return_tokens_as_token_ids: bool = False  # vLLM's; not supported (a 400 when true)
    return_token_ids: bool = False  # vLLM's; not supported (a 400 when true)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def check_stream_options(self) -> None:
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", "stream_options")  # ({}: fine)
        if self.prompt_logprobs is not None and self.stream:  # a chunk has no field for them
            raise ApiError(400, "prompt_logprobs are not available with stream=true", "prompt_logprobs")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict | None = None
                        ) -> SamplingParams:
        """`defaults`: the model's recommended values (its generation_config.json), for the fields left unset."""
        if self.length_penalty != 1.0:
            raise ApiError(400, "length_penalty applies to use_beam_search only", "length_penalty")
        for name in ("return_tokens_as_token_ids", "return_token_ids"):  # vLLM's; refused rather than ignored
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported", name)
        defaults = dict(defaults or {})
        default_max_tokens = defaults.pop("max_tokens", None)
        max_tokens = default_max_tokens if max_tokens is None else max_tokens
        given = defaults | {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        if self.logit_bias:
            bad = next((k for k in self.logit_bias if not (k.isascii() and k.isdigit() and len(k) <= 20)), None)
            if bad is not None:
                raise ValueError(f"logit_bias keys must be token ids, got {bad!r:.40}")
            given["logit_bias"] = {int(key): value for key, value in self.logit_bias.items()}
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, structured_outputs=self._structured_outputs(),
                              **given)

    def beam_search_params(self, max_tokens: int, max_logprobs: int) -> BeamSearchParams:
        """use_beam_search: the n best of n beams (2n logprobs per step: at most the engine's max_logprobs). A
        field beam search would not follow is a 400, not ignored."""
        unfollowed = sorted(name for name in self.model_fields_set & _NOT_IN_BEAM_SEARCH
                            if getattr(self, name) != type(self).model_fields[name].default)
        if unfollowed:
            raise ApiError(400, f"use_beam_search follows n, max_tokens, temperature, ignore_eos, length_penalty and "
                                f"skip_special_tokens only, not {unfollowed}", unfollowed[0])
        try:
            params = BeamSearchParams(self.n, max_tokens, self.ignore_eos, self.temperature or 0.0, self.length_penalty)
            params.check_width(max_logprobs)
            return params
        except (TypeError, ValueError) as e:
            name = str(e).split(" ", 1)[0]
            raise ApiError(400, str(e).replace("beam_width", "n (the beam width)", 1),
                           "n" if name == "beam_width" else name) from None

    @property
    def constraint_field(self) -> str:
        """The request field that carried the output's grammar: errors about the grammar name it."""
        if (self.response_format or {}).get("type") in ("json_object", "json_schema"):
            return "response_format"
        return next(iter(self._guided()), "structured_outputs")

    def _guided(self) -> dict:
        """The guided_* fields given, by their names ("guided_regex": ...)."""
        return {f"guided_{n}": value for n in _GUIDED_FIELDS if (value := getattr(self, f"guided_{n}")) is not None}

    def _structured_outputs(self) -> dict | None:
        structured = self.structured_outputs
        guided = self._guided()
        if guided:
            if structured is not None or len(guided) > 1:
                names = list(guided) + ["structured_outputs"] * (structured is not None)
                raise ApiError(400, f"give one way of constraining the output, got {names}", names[0])
            structured = {name.removeprefix("guided_"): value for name, value in guided.items()}
        kind = None if self.response_format is None else self.response_format.get("type", "(none)")
        if kind not in (None, "text", "json_object", "json_schema"):
            raise ApiError(400, f"response_format type must be text, json_object or json_schema, got {kind!r:.40}",
                           "response_format")
        if kind in ("json_object", "json_schema") and structured is not None:
            raise ApiError(400, "give response_format or structured_outputs, not both", "structured_outputs")
        if kind == "json_object":
            return {"json_object": True}
        if kind == "json_schema":
            spec = self.response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ApiError(400, 'response_format json_schema needs {"json_schema": {"name": ..., "schema": '
                                    '{...}}}', "response_format")
            return {"json": spec["schema"]}
        return structured


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class CompletionRequest(GenerationRequest):
    # vLLM's reading: max_tokens left out is 16, an explicit null is the rest of the context (or the model's default).
    _null_means_none: ClassVar[frozenset[str]] = frozenset({"max_tokens"})
    prompt: Any  # checked by prompts(): pydantic's union errors would not say what is allowed
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        """Refuse (400) fields whose meaning this server does not implement, instead of ignoring them."""
        if self.suffix is not None:
            raise ApiError(400, "suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, "best_of is not supported (it may only equal n)", "best_of")

    def prompts(self) -> list[str | list[int]]:
        return _prompt_list(self.prompt, "prompt")


def _prompt_list(prompt: object, name: str) -> list[str | list[int]]:
    """A prompt field (`prompt`, an embedding's `input`) as a list of prompts (a string or token ids each)."""
    if isinstance(prompt, str) or (_is_token_ids(prompt) and prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(_is_token_ids(p) for p in prompt)):
        return prompt
    if prompt == []:
        raise ApiError(400, f"{name} is empty", name)
    raise ApiError(400, f"{name} must be a string, a list of strings, a list of token ids or a list of lists "
                        f"of token ids", name)


class ContentPart(_Body):
    type: str
    text: str | None = None
    refusal: str | None = None  # a "refusal" part's text (an assistant's earlier refusal)


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a "tool" message: the call it answers

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: text content only."""
        content = self.content
        if isinstance(content, list):
            try:
                content = content_text([part.model_dump(exclude_none=True) for part in content])
            except ValueError as e:
                raise ApiError(400, str(e), "messages") from None
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as the chat template gets them (also with tool_choice "none", as vLLM by default)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    tools: list[Tool] | None = None
    tool_choice: str | dict | None = None  # "none", "auto", "required" or a NamedToolChoice; default: auto with tools
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables, e.g. {"enable_thinking": false}
    chat_template: str | None = None  # vLLM's: a Jinja template for this request (--trust-request-chat-template)
    include_reasoning: bool = True  # with --reasoning-parser: return reasoning_content (False: drop it)

    @property
    def echoed(self) -> str:
        """What `echo` puts before the reply (vLLM's): the last message's text when it is the assistant's own,
        the start of the reply the model continues (`continue_final_message`); otherwise nothing."""
        last = self.messages[-1] if self.messages else None
        if not self.echo or last is None or last.role != "assistant":
            return ""
        return last.to_template()["content"] or ""

    @functools.cached_property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """The tool_choice in force, read once per request (the checks, the grammar and each choice's reader ask)."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        if isinstance(self.tool_choice, str) and self.tool_choice in ("none", "auto", "required"):
            return self.tool_choice
        try:
            return NamedToolChoice.model_validate(self.tool_choice)
        except ValidationError:
            raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                                f'{{"name": ...}}}}, got {json.dumps(self.tool_choice)[:80]}', "tool_choice") from None

    def check_tools(self, parser: str | None) -> None:
        """400 for tool fields that cannot be served; `parser`: the server's auto tool choice parser, if any."""
        choice = self.effective_tool_choice
        names: set[str] = set()
        for tool in self.tools or ():
            if tool.function.name in names:
                raise ApiError(400, f"tools has two functions named {tool.function.name!r:.80}", "tools")
            names.add(tool.function.name)
        if choice != "none" and not self.tools:
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        if choice == "auto" and parser is None:
            raise ApiError(400, 'tool_choice "auto" needs a server started with --enable-auto-tool-choice and '
                                '--tool-call-parser; "required", "none" or a named function work on any server',
                           "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ApiError(400, f"tool_choice names the function {choice.function.name!r:.80}, which is not among "
                                f"the tools", "tool_choice")

    def tool_call_extractor(self, parser: str | None) -> ToolCallExtractor | None:
        """A new reader of one choice's tool calls, or None when the reply is plain content."""
        choice = self.effective_tool_choice
        if choice == "none":
            return None
        if choice == "auto":
            return TOOL_CALL_PARSERS[parser](self.parallel_tool_calls)
        if choice == "required":
            return RequiredToolCalls(self.parallel_tool_calls)
        return NamedToolCall(choice.function.name)

    def _structured_outputs(self) -> dict | None:
        """tool_choice "required" or a named function: the output is constrained to the calls' JSON schema,
        written without free whitespace."""
        choice = self.effective_tool_choice
        if choice in ("none", "auto"):
            return super()._structured_outputs()
        if super()._structured_outputs() is not None:
            raise ApiError(400, 'tool_choice "required" or a named function constrains the output itself: send no '
                                'response_format, structured_outputs or guided_* field with it', "tool_choice")
        tools = template_tools(self.tools)
        schema = required_schema(tools, self.parallel_tool_calls) if choice == "required" else \
            parameters_schema(tools, choice.function.name)
        return {"json": schema, "disable_any_whitespace": True}  # arguments for a program: no room to pad them


class PoolingRequest(_Body):
    """What the embedding model's endpoints share (vLLM's extras)."""

    model: str | None = None
    request_id: str | None = None  # names the response, as a generation request's
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    cache_salt: str | None = None
    stream: ClassVar[bool] = False  # one response, always

    def pooling_params(self, normalize: bool | None = None, dimensions: int | None = None) -> PoolingParams:
        try:
            return PoolingParams(normalize, dimensions, self.truncate_prompt_tokens)
        except (TypeError, ValueError) as e:  # its messages begin with the field's name
            raise ApiError(400, str(e), str(e).split(" ", 1)[0]) from None


class EmbeddingRequest(PoolingRequest):
    """/v1/embeddings: OpenAI's fields, and vLLM's truncate_prompt_tokens, normalize, priority and cache_salt."""

    input: Any = None  # checked by prompts()
    # vLLM's chat form, instead of input: one conversation through the chat template.
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"  # vLLM's: base64's element type
    endianness: Literal["native", "little", "big"] = "native"  # vLLM's: base64's byte order
    dimensions: int | None = None
    user: str | None = None
    normalize: bool | None = None

    def prompts(self) -> list[str | list[int]]:
        return _prompt_list(self.input, "input")

    def check_form(self) -> None:
        if (self.input is None) == (self.messages is None):
            raise ApiError(400, "give input (texts or token ids) or messages (a conversation), one of the two",
                           "input")


class ScoreRequest(PoolingRequest):
    """/score: vLLM's `queries` and `documents` (or its older `text_1` and `text_2`): one query against each
    document, or the two lists pair by pair."""

    queries: Any = None
    documents: Any = None
    items: Any = None
    data_1: Any = None
    data_2: Any = None
    text_1: Any = None
    text_2: Any = None

    def sides(self) -> tuple[list[str | list[int]], list[str | list[int]]]:
        """The two sides, by any of the names vLLM's /score has taken."""
        given = tuple(name for name in ("queries", "documents", "items", "data_1", "data_2", "text_1", "text_2")
                      if getattr(self, name) is not None)
        if given not in _SCORE_SIDES:
            raise ApiError(400, f"give one pair of {' / '.join(' and '.join(pair) for pair in _SCORE_SIDES)}, got "
                                f"{list(given)}", None)
        first, second = given
        return _prompt_list(getattr(self, first), first), _prompt_list(getattr(self, second), second)


_SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class RerankRequest(PoolingRequest):
    """/rerank (Jina's and Cohere's API, as vLLM serves it): the documents ordered by relevance to the query."""

    query: str
    documents: list[str]
    top_n: int | None = None  # the best n (None or <= 0: all, as vLLM's)
    return_documents: bool = True

    def prompts(self) -> list[str]:
        if not self.documents:
            raise ApiError(400, "documents is empty", "documents")
        return [self.query, *self.documents]


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None  # with messages: rendered by the chat template as in a chat completion
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # with messages: as in a chat completion


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Body):
    """vLLM's /v1/load_lora_adapter: a PEFT adapter folder on the server's machine, served as `lora_name`."""

    lora_name: Annotated[str, StringConstraints(min_length=1)]
    lora_path: Annotated[str, StringConstraints(min_length=1)]


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's /v1/unload_lora_adapter, by name (its lora_int_id field, which vLLM does not read either, is ignored
    as any unknown field)."""

    lora_name: str


def parse_body(model: type[_Body], data: object) -> Any:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        error = e.errors()[0]
        loc = [str(part) for part in error["loc"]]
        where = f"{'.'.join(loc)}: " if loc else ""
        raise ApiError(400, f"{where}{error['msg']}", loc[0] if loc else None) from None
