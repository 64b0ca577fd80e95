"""The OpenAI generation endpoints: a request body becomes prompts and SamplingParams
(or, with use_beam_search, beam-search steps), goes through the CoreClient, and
comes back as one JSON response or as server-sent events. Also /tokenize and
/detokenize, which share the chat template handling. The embedding model's
endpoints (pooling.py) admit their texts through the same `generate`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from nanoinfer.engine.beam_search import BeamSearch, advance_all, live_beams
from nanoinfer.engine.core import EngineDeadError
from nanoinfer.engine.output_processor import token_text
from nanoinfer.lora.request import LoRARequest
from nanoinfer.outputs import CompletionOutput, Logprob, RequestOutput
from nanoinfer.pooling_params import PoolingParams
from nanoinfer.sampling_params import SamplingParams, StructuredOutputsParams
from nanoinfer.server.core_client import CoreClient, OutputStream
from nanoinfer.server.models import OpenAIServingModels
from nanoinfer.server.protocol import (ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       EmbeddingRequest, GenerationRequest, PoolingRequest, TokenizeRequest,
                                       template_tools)
from nanoinfer.sample.think import OPENING, ThinkTags, reply_phase
from nanoinfer.server.reasoning import ThinkReasoning
from nanoinfer.server.tool_calls import ToolCallExtractor

# Words that start our validation messages ("top_p must be ...") and name a request field.
_FIELD_NAMES = {f.name for f in dataclasses.fields(SamplingParams) + dataclasses.fields(PoolingParams)} | {
    "prompt", "priority", "tools", "chat_template", "chat_template_kwargs"}
# Fields an endpoint takes under another name for the same value: its errors say the client's name.
_SAME_VALUE_RENAMES = frozenset({"max_tokens", "logprobs"})
_MIN_LOGPROB = -9999.0  # JSON has no -inf
_RETRY_AFTER_SECONDS = "1"
_OFF_LOOP_BODY_BYTES = 16 << 10  # 16 KB of text: ~4 ms to tokenize on a slow core

logger = logging.getLogger("nanoinfer")


def _bad_request(error: Exception, renames: dict[str, str], param: str | None = None) -> ApiError:
    """A 400 for a validation error. Our messages start with the field they are about ("top_p must be ...",
    "structured_outputs.json ..."): `param` names it as this endpoint calls it (`renames`), and where the client
    sent a field by another name for the same value (max_completion_tokens, top_logprobs) the message does too."""
    message = str(error)
    word = message.split(" ", 1)[0].split(".", 1)[0].rstrip(":")
    if word in _FIELD_NAMES:
        param = renames.get(word, word)
    for name in _SAME_VALUE_RENAMES & renames.keys():  # wherever the message names it ("prompt + max_tokens ...")
        message = re.sub(rf"\b{name}\b", renames[name], message)
    return ApiError(400, message, param)


def request_ids(prefix: str, raw: Request, named: str | None) -> tuple[str, str]:
    """(the response's id, the engine's). As vLLM's, a client may name its request (the X-Request-Id header, else
    the body's request_id): the response's id is then that name, prefixed. The engine's id is always a fresh one,
    unique however clients name their requests."""
    fresh = f"{prefix}-{uuid.uuid4().hex}"
    named = raw.headers.get("x-request-id") or named
    if not named:
        return fresh, fresh
    logger.info("request %s is the client's %r", fresh, named[:200])  # the log names the engine's id
    return f"{prefix}-{named}", fresh


def _request_failed(request_id: str) -> ApiError:
    return ApiError(500, f"generating {request_id} failed inside the engine; the server log has the details")


def _json_logprob(logprob: float) -> float:
    """A logprob JSON can carry: -inf (and a NaN, were one to come) as _MIN_LOGPROB."""
    return logprob if logprob > _MIN_LOGPROB else _MIN_LOGPROB


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _without_generated(output: RequestOutput) -> RequestOutput:
    """The output with its completions' tokens, text and logprobs left out (echo with max_tokens 0): what
    ended the hidden token (a stop string, eos) is not the response's reason, its length is."""
    return dataclasses.replace(output, outputs=[
        dataclasses.replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
                            finish_reason=None if c.finish_reason is None else "length", stop_reason=None)
        for c in output.outputs])


def _usage(outputs: list[RequestOutput]) -> dict:
    """The usage of whole (final) outputs."""
    return _usage_counts(sum(len(o.prompt_token_ids) for o in outputs),
                         sum(len(c.token_ids) for o in outputs for c in o.outputs),
                         sum(o.num_cached_tokens for o in outputs))


def _usage_counts(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


@dataclass
class _Delta:
    """New output of one choice since the stream last sent it."""

    index: int  # the choice's index in the response: prompt position x n + child index
    output: RequestOutput
    completion: CompletionOutput  # its new text, tokens and logprobs
    text_offset: int  # where the new text starts in the choice's whole text
    first: bool


@dataclass
class _Sent:
    text_len: int = 0  # characters sent so far
    num_tokens: int = 0  # tokens counted so far
    started: bool = False
    finished: bool = False


class _DeltaTracker:
    """Turns a stream's delta outputs into per-choice chunks, and counts its usage."""

    def __init__(self, request_ids: list[str], n: int) -> None:
        self.position = {request_id: i for i, request_id in enumerate(request_ids)}
        self.n = n
        self.sent: dict[tuple[str, int], _Sent] = {}
        self.prompt_tokens: dict[str, int] = {}
        self.cached_tokens: dict[str, int] = {}

    def update(self, updates: dict[str, RequestOutput]) -> Iterator[_Delta]:
        for request_id, output in updates.items():
            self.prompt_tokens[request_id] = len(output.prompt_token_ids)
            self.cached_tokens[request_id] = output.num_cached_tokens
            for c in output.outputs:
                sent = self.sent.setdefault((request_id, c.index), _Sent())
                if sent.finished:
                    continue
                sent.num_tokens += len(c.token_ids)
                # A chunk per new token, even while its text lags (an incomplete character, a possible stop
                # string, an id the tokenizer cannot decode): as vLLM, so time to first token and between
                # tokens mean the tokens, and a client sees each token's logprobs as it is sampled.
                if not (c.text or c.token_ids or c.finish_reason is not None):
                    continue
                yield _Delta(self.position[request_id] * self.n + c.index, output, c, sent.text_len, not sent.started)
                sent.text_len += len(c.text)
                sent.started, sent.finished = True, c.finish_reason is not None

    def usage(self) -> dict:
        return _usage_counts(sum(self.prompt_tokens.values()), sum(s.num_tokens for s in self.sent.values()),
                             sum(self.cached_tokens.values()))

    def choice_usage(self, delta: _Delta) -> dict:
        """vLLM's continuous_usage_stats: a chunk's usage is its own choice's, its prompt and its tokens so far."""
        request_id = delta.output.request_id
        return _usage_counts(self.prompt_tokens[request_id], self.sent[(request_id, delta.completion.index)].num_tokens,
                             self.cached_tokens[request_id])


class EventStreamResponse(StreamingResponse):
    """Server-sent events that run `on_close` however they end: done, failed, or the client gone."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _client_disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


class OpenAIServing:
    def __init__(self, client: CoreClient, models: OpenAIServingModels, log_prompts: bool = False,
                 tool_call_parser: str | None = None, trust_request_chat_template: bool = False) -> None:
        self.client = client
        self.models = models  # the names a request's model may take: the base model's and the LoRA adapters'
        self.log_prompts = log_prompts
        self.trust_request_chat_template = trust_request_chat_template
        self.tool_call_parser = tool_call_parser  # reads tool_choice "auto" replies; None: auto is refused
        self.tokenizer = client.tokenizer
        # Splits <think> reasoning from content (None: all is content). With tags that are single tokens the engine
        # holds a reply's grammar until its reasoning ends, and the reply's first phase is read from its prompt.
        self.reasoning_parser = client.config.reasoning_parser
        self.think = ThinkTags.of(self.tokenizer, self.reasoning_parser, client.limits.vocab_size)
        self.accepting = True  # False while draining for shutdown
        self.num_beam_searches = 0  # in flight: a drain waits for them too (between steps none of theirs runs)
        self.aborting = False  # the drain's time is up: beam searches take no further step
        # Large requests are tokenized here (`_tokenizing`), one at a time in arrival order; grammars are checked in
        # threads of their own (`_checked`).
        self.tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        if self.tokenizer is not None:
            # transformers clears a tokenizer.json's truncation / padding on the first encode: a write that would
            # race with the event loop's decodes ("Already borrowed") if it first happened in the thread.
            self.tokenizer.encode("warm-up")

    async def _tokenizing(self, raw: Request, req: GenerationRequest | PoolingRequest | TokenizeRequest,
                          fn: Callable, *args):
        """fn(*args), which tokenizes (or renders a chat template), where it cannot stall the streams in flight:
        in the tokenizer thread for a large body (the tokenizer releases the GIL: 2 MB of text took ~1.5 s on a
        CPU core, during which every stream stood still), on the event loop for a small body (a few ms at most;
        handing every request to the thread cost ~0.5 ms of median time to first token at 16 req/s on an H200
        host, the thread waiting for the GIL while the loop streams). A request with its own chat template goes to
        the thread however small: the template may write megabytes."""
        if raw.state.body_size <= _OFF_LOOP_BODY_BYTES and getattr(req, "chat_template", None) is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, functools.partial(fn, *args))

    async def _checked(self, spec: StructuredOutputsParams | None) -> None:
        """A request's grammar checked before its admission does (which then finds it done), awaited here: it is
        parsed in threads of its own (a schema of 7,000 properties takes ~0.3 s), so a slow grammar delays neither
        the streams, nor the tokenizer thread's large bodies, nor other grammars. A grammar that cannot compile is
        left for the admission's check to report."""
        if spec is None or self.tokenizer is None:
            return
        future = self.client.input_processor.grammar_checks().get(spec)
        with contextlib.suppress(ValueError):  # (shielded: a client that leaves cancels not the shared check)
            await asyncio.shield(asyncio.wrap_future(future))

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's model names (None: the base model); a 404 for a name not served."""
        return self.models.lora_request(name)

    def response_model(self, name: str | None) -> str:
        """A response's "model", as vLLM's: the served name the request gave, else the first."""
        return name or self.models.base_model_names[0]

    def check_runner(self, embeddings: bool) -> None:
        """A server makes either embeddings (--runner pooling) or text: the other kind's endpoints are 404s."""
        if embeddings and self.client.pooler is None:
            raise ApiError(404, "this server generates text: the embedding endpoints (/v1/embeddings, /pooling, "
                                "/score, /rerank) need a server started with --runner pooling")
        if not embeddings and self.client.pooler is not None:
            raise ApiError(404, "this server makes embeddings (--runner pooling): it serves /v1/embeddings, not "
                                "text generation")

    # ----- /v1/completions -----

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        lora = self.check_model(req.model)
        self.check_runner(embeddings=False)
        req.check_supported()
        # echo with max_tokens 0 scores the prompt alone (as vLLM): one token is made, and left out of the response.
        echo_only = req.echo and req.max_tokens == 0
        if echo_only and req.min_tokens:
            raise ApiError(400, "min_tokens must be 0 with max_tokens 0", "min_tokens")
        renames = {"structured_outputs": req.constraint_field}
        response_id, request_id = request_ids("cmpl", raw, req.request_id)
        if req.use_beam_search:
            stream = await self._beam_search(request_id, req.prompts, req, req.max_tokens, renames, raw, lora)
        else:
            params = self._sampling_params(req, 1 if echo_only else req.max_tokens, req.logprobs, renames)
            if req.echo and req.logprobs is not None:  # the echoed prompt gets logprobs too, as in OpenAI's API
                params = dataclasses.replace(params, prompt_logprobs=max(req.logprobs, req.prompt_logprobs or 0))
            stream = await self.generate(request_id, req.prompts, params, req, renames, raw, lora)
        if stream is None:  # the client went away during a beam search
            return Response(status_code=499)
        prompt_logprobs: dict[str, list] = {}  # per prompt: a stream carries them once, every choice echoes them
        echoed: dict[int, int] = {}  # per choice: the echoed prompt's length, where its generated text starts

        def choice(d: _Delta, streaming: bool) -> dict:
            c = d.completion
            echo = self._prompt_text(d.output) if req.echo and d.first else ""
            if d.first:
                echoed[d.index] = len(echo)
            logprobs = None
            if c.logprobs is not None:
                if d.output.prompt_logprobs is not None:
                    prompt_logprobs[d.output.request_id] = d.output.prompt_logprobs
                logprobs = self._completion_logprobs(c.token_ids, c.logprobs, echoed[d.index] + d.text_offset)
                if echo:
                    ids = d.output.prompt_token_ids
                    known = prompt_logprobs.get(d.output.request_id) or [None] * len(ids)  # none: ended first
                    # As wide as the generated tokens' (a larger prompt_logprobs computed them): the token, top-n.
                    known = [lp and {i: v for i, v in lp.items() if i == t or v.rank <= req.logprobs}
                             for t, lp in zip(ids, known)]
                    prompt = self._completion_logprobs(ids, known, 0)
                    logprobs = {key: prompt[key] + logprobs[key] for key in logprobs}
            return {"index": d.index, "text": echo + c.text, "logprobs": logprobs,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    **({"prompt_logprobs": self._prompt_logprobs(d.output)} if req.prompt_logprobs is not None else {})}

        return await self._respond(stream, raw, req, req.n, response_id, ("text_completion", "text_completion"),
                                   choice, _without_generated if echo_only else None)

    # ----- /v1/chat/completions -----

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        lora = self.check_model(req.model)
        self.check_runner(embeddings=False)
        req.check_tools(self.tool_call_parser)
        max_name = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
        renames = {"prompt": "messages", "logprobs": "top_logprobs", "max_tokens": max_name,
                   "structured_outputs": req.constraint_field}
        if req.effective_tool_choice not in ("none", "auto"):  # the tools' schemas became the grammar
            renames["structured_outputs"] = "tools"
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
        response_id, request_id = request_ids("chatcmpl", raw, req.request_id)
        tools = template_tools(req.tools)

        def prompts() -> list[list[int]]:
            return [self.chat_prompt(req, tools)]

        constrained = False  # a grammar applies (from the first token unless the engine follows the think tags)
        if req.use_beam_search:
            stream = await self._beam_search(request_id, prompts, req, max_tokens, renames, raw, lora)
            if stream is None:  # the client went away
                return Response(status_code=499)
        else:
            params = self._sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                           renames)
            if req.effective_tool_choice == "auto":  # as vLLM's: a tokenizer may mark <tool_call> special
                params = dataclasses.replace(params, skip_special_tokens=False)
            constrained = params.structured_outputs is not None
            stream = await self.generate(request_id, prompts, params, req, renames, raw, lora)
        # Per choice, the readers its text goes through: reasoning apart from content, then tool calls out of it.
        readers: dict[int, tuple[ThinkReasoning | None, ToolCallExtractor | None]] = {}

        def choice(d: _Delta, streaming: bool) -> dict:
            c = d.completion
            if d.index not in readers:
                readers[d.index] = (self.reasoning_parser and ThinkReasoning(self._reply_phase(d.output, constrained),
                                                                             first_token=self.think is not None),
                                    req.tool_call_extractor(self.tool_call_parser))
            reasoner, extractor = readers[d.index]
            final = c.finish_reason is not None
            reasoning, text = ("", c.text) if reasoner is None else reasoner.feed(c.text, final)
            content, calls = (text, []) if extractor is None else extractor.feed(text, final)
            if d.first:
                content = req.echoed + content
            if streaming:  # a chunk of only calls or reasoning has null content, as OpenAI's
                message = {"content": None if not content and (calls or reasoning) else content}
                if d.first:
                    message = {"role": "assistant"} | message
                if reasoning and req.include_reasoning:
                    message["reasoning_content"] = reasoning
            else:  # a whole reply: no call indexes, and no content beside calls unless there was some
                message = {"role": "assistant", "content": None if not content and (calls or reasoning) else content}
                if reasoner is not None and req.include_reasoning:
                    message["reasoning_content"] = reasoning or None
                calls = [{key: value for key, value in call.items() if key != "index"} for call in calls]
            if calls:
                message["tool_calls"] = calls
            return {"index": d.index, "delta" if streaming else "message": message,
                    "logprobs": None if c.logprobs is None else
                    self._chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0),
                    "finish_reason": c.finish_reason if extractor is None else extractor.finish_reason(c.finish_reason),
                    "stop_reason": c.stop_reason}

        return await self._respond(stream, raw, req, req.n, response_id, ("chat.completion.chunk", "chat.completion"),
                                   choice, top=lambda outputs: {"prompt_logprobs": self._prompt_logprobs(outputs[0])}
                                   if req.prompt_logprobs is not None else {})

    def _reply_phase(self, output: RequestOutput, constrained: bool) -> str:
        """Where a chat reply starts (sample/think.py): read from the end of its prompt where the tags are tokens
        (the engine decides the same way); otherwise from the parser alone, or, under a grammar that applied from
        the first token, reasoning only where the grammar opens a think block."""
        if self.think is not None:
            return self.think.first_phase(output.prompt_token_ids)
        return OPENING if constrained else reply_phase(self.reasoning_parser, None)

    def chat_prompt(self, req: ChatCompletionRequest | EmbeddingRequest | TokenizeRequest,
                    tools: list[dict] | None = None) -> list[int]:
        """The request's conversation (and the tools it may call) through the chat template, as token ids: the
        model's template, or the request's own chat_template where the server trusts its clients with one."""
        if not req.messages:
            raise ApiError(400, "messages is empty", "messages")
        if req.chat_template is not None and not self.trust_request_chat_template:
            raise ApiError(400, "chat_template was given with the request, but this server renders the model's own "
                                "template only (start it with --trust-request-chat-template to allow yours)",
                           "chat_template")
        try:
            return self.client.input_processor.render_chat(
                [m.to_template() for m in req.messages], req.add_generation_prompt, req.continue_final_message, tools,
                req.chat_template_kwargs, req.chat_template)["prompt_token_ids"]
        except ValueError as e:  # chat_template(_kwargs)' own errors name it; the rest are the messages'
            raise _bad_request(e, {"prompt": "messages"}, "messages") from None

    # ----- /tokenize, /detokenize -----

    async def tokenize(self, req: TokenizeRequest, raw: Request) -> dict:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", "prompt")
        token_ids = await self._tokenizing(raw, req, self._token_ids, req)
        limit = self.client.limits.max_tokens_per_request  # the context, or the KV cache when it holds less
        return {"count": len(token_ids), "max_model_len": limit, "tokens": token_ids}

    def _token_ids(self, req: TokenizeRequest) -> list[int]:
        if req.messages is not None:
            return self.chat_prompt(req, template_tools(req.tools))
        elif self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer", "prompt")
        else:
            try:
                self.client.input_processor.check_prompt_chars(len(req.prompt))
            except ValueError as e:
                raise ApiError(400, str(e), "prompt") from None
            return self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)

    def detokenize(self, req: DetokenizeRequest) -> dict:
        self.check_model(req.model)
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer", "tokens")
        vocab_size = self.client.limits.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    # ----- shared -----

    def _sampling_params(self, req: GenerationRequest, max_tokens: int | None, logprobs: int | None,
                         renames: dict[str, str]) -> SamplingParams:
        req.check_stream_options()
        try:
            return req.sampling_params(max_tokens, logprobs, self.client.default_sampling)
        except (TypeError, ValueError) as e:
            raise _bad_request(e, renames) from None

    async def generate(self, request_id: str, make_prompts: Callable[[], list[str | list[int]]],
                        params: SamplingParams | PoolingParams,
                        req: GenerationRequest | PoolingRequest,
                        renames: dict[str, str], raw: Request, lora_request: LoRARequest | None = None,
                        beam_step: bool = False) -> OutputStream:
        """Admit the request: its prompts are made (a chat template rendered) and tokenized (`_tokenizing`),
        then registered with the core on the event loop. `lora_request`: the adapter its model named (resolved
        once, as the request arrived, so an adapter unloaded meanwhile still serves it). `beam_step`: a step of a
        beam search admitted before any drain began, so it runs while the server drains."""
        if not (self.accepting or beam_step):
            raise ApiError(503, "the server is shutting down")
        self.client.check_alive()  # fail fast, before the tokenizer works for nothing

        def admit() -> tuple[list[str | list[int]], list]:
            prompts = make_prompts()
            return prompts, self.client.admit(request_id, prompts, params, req.priority, req.cache_salt, lora_request)

        try:
            await self._checked(getattr(params, "structured_outputs", None))
            prompts, admitted = await self._tokenizing(raw, req, admit)
            if not (self.accepting or beam_step):  # the drain began while the prompt was tokenized
                raise ApiError(503, "the server is shutting down")
            if self.log_prompts:
                texts = [p if isinstance(p, str) or self.tokenizer is None else self.tokenizer.decode(p)
                         for p in prompts]
                logger.info("request %s: prompts %r, %s, priority %d, cache_salt %r, lora %r", request_id, texts,
                            params, req.priority, req.cache_salt, lora_request and lora_request.lora_name)
            return self.client.register(request_id, params, admitted, req.stream)
        except (TypeError, ValueError) as e:
            raise _bad_request(e, renames) from None
        except OverflowError as e:
            raise ApiError(503, f"{e}; retry later", headers={"Retry-After": _RETRY_AFTER_SECONDS}) from None

    async def _beam_search(self, request_id: str, make_prompts: Callable[[], list[str | list[int]]],
                           req: GenerationRequest, max_tokens: int | None, renames: dict[str, str],
                           raw: Request, lora_request: LoRARequest | None) -> OutputStream | None:
        """use_beam_search: every step's live beams as one-token requests through `generate`, as vLLM's server
        runs them; the result, each prompt's n best sequences as its choices, in a stream that already holds it
        (so a streaming request gets them as one chunk each). None if the client went away meanwhile."""
        if not self.accepting:
            raise ApiError(503, "the server is shutting down")
        req.check_stream_options()
        self.num_beam_searches += 1  # admitted: a drain lets it finish, as it does any request in flight
        try:
            prompts, searches = await self._beam_steps(request_id, make_prompts, req, max_tokens, renames, raw,
                                                       lora_request)
        finally:
            self.num_beam_searches -= 1
        if searches is None:
            return None
        stream = OutputStream([f"{request_id}-{i}" for i in range(len(prompts))])
        for output_id, ids, search in zip(stream.request_ids, prompts, searches):
            choices = [CompletionOutput(j, self.tokenizer.decode(beam.text_token_ids(len(ids)), skip_special_tokens=
                                                                 req.skip_special_tokens) if self.tokenizer else "",
                                        beam.tokens[len(ids):], None, beam.finish_reason)
                       for j, beam in enumerate(search.best())]
            stream.put(RequestOutput(output_id, None, ids, choices, finished=True))
        return stream

    async def _beam_steps(self, request_id: str, make_prompts: Callable[[], list[str | list[int]]],
                          req: GenerationRequest, max_tokens: int | None, renames: dict[str, str], raw: Request,
                          lora_request: LoRARequest | None) -> tuple[list[list[int]], list[BeamSearch] | None]:
        """The prompts' token ids and their searches run to the end (None if the client went away)."""
        try:  # the bounds a request's sampling would meet: the context, and the server's output tokens
            prompts = await self._tokenizing(raw, req, lambda: [self.client.input_processor.tokenize(p)
                                                           for p in make_prompts()])
            longest = max(map(len, prompts))
            params = req.beam_search_params(self.client.input_processor.check_length(longest, max_tokens),
                                            self.client.limits.max_logprobs)
            self.client.check_output_tokens(params.beam_width * params.max_tokens * len(prompts), max_tokens is None)
            self.client.limits.check_waiting_room(0, params.beam_width * len(prompts))  # each step's beams
        except (TypeError, ValueError) as e:
            raise _bad_request(e, renames) from None
        searches = [BeamSearch(ids, params, self.client.limits.eos_token_ids) for ids in prompts]
        step = 0
        while beams := live_beams(searches):
            if self.aborting:  # the drain's time ran out between two steps
                raise ApiError(503, "the server is shutting down")
            outputs = await self.collect(await self.generate(
                f"{request_id}-{step}", lambda: [beam.tokens for _, beam in beams], params.step_params(), req,
                renames, raw, lora_request, beam_step=True), raw)
            if outputs is None:
                return prompts, None
            reasons = {c.finish_reason for o in outputs for c in o.outputs}
            if "abort" in reasons:  # the drain's time ran out during the step
                raise ApiError(503, "the server is shutting down")
            if "error" in reasons:
                raise _request_failed(request_id)
            advance_all(beams, outputs)
            step += 1
        return prompts, searches

    async def _respond(self, stream: OutputStream, raw: Request, req: GenerationRequest, n: int, response_id: str,
                       objects: tuple[str, str], render: Callable[[_Delta, bool], dict],
                       reshape: Callable[[RequestOutput], RequestOutput] | None = None,
                       top: Callable[[list[RequestOutput]], dict] | None = None) -> Response:
        """Server-sent chunks of `render(delta, streaming=True)`, or one JSON response once all is done.
        `objects`: the "object" field of a chunk and of a whole response; `reshape`: applied to every output
        first (so usage counts what the response holds); `top`: more fields of a whole response."""
        base = {"id": response_id, "created": int(time.time()), "model": self.response_model(req.model)}
        if req.stream:
            events = self._events(stream, n, base | {"object": objects[0]}, lambda d: render(d, True), req, reshape)
            return EventStreamResponse(events, lambda: self.client.abort(stream))
        outputs = await self.collect(stream, raw)
        if outputs is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        if reshape is not None:
            outputs = [reshape(o) for o in outputs]
        if any(c.finish_reason == "error" for o in outputs for c in o.outputs):
            raise _request_failed(response_id)
        choices = [render(_Delta(i * n + c.index, o, c, 0, True), False)
                   for i, o in enumerate(outputs) for c in o.outputs]
        return JSONResponse(base | {"object": objects[1], "choices": choices, "usage": _usage(outputs)}
                            | (top(outputs) if top is not None else {}))

    async def collect(self, stream: OutputStream, raw: Request) -> list[RequestOutput] | None:
        """The final outputs in prompt order; None if the client went away first (then it is aborted)."""

        async def consume() -> list[RequestOutput]:
            final: dict[str, RequestOutput] = {}
            async for updates in stream:
                final.update(updates)
            return [final[request_id] for request_id in stream.request_ids]

        task = asyncio.ensure_future(consume())
        disconnected = asyncio.ensure_future(_client_disconnected(raw))
        try:
            done, _ = await asyncio.wait((task, disconnected), return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnected.cancel()
            if not task.done():
                task.cancel()
            self.client.abort(stream)
        return task.result() if task in done else None

    async def _events(self, stream: OutputStream, n: int, base: dict, render: Callable[[_Delta], dict],
                      req: GenerationRequest, reshape: Callable[[RequestOutput], RequestOutput] | None
                      ) -> AsyncIterator[str]:
        """The chunks of a stream; with include_usage each carries `"usage": null` (continuous_usage_stats: its
        choice's usage so far) and a last chunk without choices the whole usage."""
        tracker = _DeltaTracker(stream.request_ids, n)
        try:
            async for updates in stream:
                if reshape is not None:
                    updates = {request_id: reshape(o) for request_id, o in updates.items()}
                for delta in tracker.update(updates):
                    if delta.completion.finish_reason == "error":
                        raise _request_failed(base["id"])
                    usage = {"usage": tracker.choice_usage(delta) if req.continuous_usage else None} \
                        if req.include_usage else {}
                    yield _event(base | {"choices": [render(delta)]} | usage)
            if req.include_usage:
                yield _event(base | {"choices": [], "usage": tracker.usage()})
        except EngineDeadError as e:
            yield _event(ApiError(503, str(e)).body())
        except ApiError as e:  # a request failed inside the engine: the stream ends (closing it aborts the rest)
            yield _event(e.body())
        yield "data: [DONE]\n\n"

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids) if self.tokenizer is not None else ""

    def _token_text(self, token_id: int, logprob: Logprob | None = None) -> str:
        """A token's text alone: its Logprob's (decoded once, by the output processor) where it has one."""
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return f"token_id:{token_id}" if self.tokenizer is None else token_text(self.tokenizer, token_id)

    def _prompt_logprobs(self, output: RequestOutput) -> list[dict | None] | None:
        """vLLM's prompt_logprobs: per prompt position, {token id: {"logprob", "rank", "decoded_token"}} for the
        prompt's own token and the top-n; null at position 0 (and in all, for a request that ended first)."""
        if output.prompt_logprobs is None:
            return None
        return [None if lp is None else {str(t): {"logprob": _json_logprob(v.logprob), "rank": v.rank,
                                                  "decoded_token": self._token_text(t, v)} for t, v in lp.items()}
                for lp in output.prompt_logprobs]

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob] | None], offset: int) -> dict:
        """OpenAI's legacy logprobs object; a None entry (an echoed prompt's first token) is null in it."""
        tokens = [self._token_text(t, lp and lp[t]) for t, lp in zip(token_ids, logprobs)]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens,
                "token_logprobs": [None if lp is None else _json_logprob(lp[t].logprob)
                                   for t, lp in zip(token_ids, logprobs)],
                "top_logprobs": [None if lp is None else {self._token_text(i, v): _json_logprob(v.logprob)
                                                          for i, v in lp.items()} for lp in logprobs],
                "text_offset": offsets}

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int) -> dict:
        def entry(token_id: int, value: Logprob) -> dict:
            text = self._token_text(token_id, value)
            return {"token": text, "logprob": _json_logprob(value.logprob), "bytes": list(text.encode())}

        return {"content": [entry(t, lp[t]) | {"top_logprobs": [entry(i, v) for i, v in
                                                                 sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:top_n]]}
                            for t, lp in zip(token_ids, logprobs)]}
