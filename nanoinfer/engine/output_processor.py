"""Front-end output handling: incremental detokenization, stop strings and
assembling each user request's `RequestOutput` from its child requests."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from nanoinfer.engine.detokenizer import IncrementalDetokenizer
from nanoinfer.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, EngineCoreOutput, Logprob,
                               RequestOutput, TokenLogprobs)
from nanoinfer.pooling_params import PoolerConfig, PoolingParams
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("nanoinfer")


def token_text(tokenizer, token_id: int) -> str | None:
    """One token's text alone, special tokens included (vLLM's `decoded_token`); None without a tokenizer."""
    return None if tokenizer is None else tokenizer.decode([token_id], skip_special_tokens=False)


@dataclass
class ChildState:
    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0  # of the sampled tokens, with logprobs
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent: int = 0  # tokens already in an output (DELTA)
    finish_sent: bool = False  # its finish_reason was in an output (DELTA: later outputs leave it out)
    decode: bool = True  # SamplingParams.detokenize: text and logprobs' decoded tokens


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: dict[str, ChildState]
    output_kind: RequestOutputKind
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # from the first child to bring them
    prompt_logprobs_sent: bool = False  # DELTA: they go out once
    pooling: PoolingParams | None = None  # an embedding's request

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


class OutputProcessor:
    def __init__(self, tokenizer, pooler: PoolerConfig | None = None) -> None:
        """`pooler`: runner="pooling", how the core's pooled vectors become embeddings."""
        self.tokenizer = tokenizer
        self.pooler = pooler
        # Each token's text alone, as logprobs give it, decoded once: logprobs name the same tokens again and again
        # (20 alternatives per token cost ~55 us to decode, ~1 us to look up).
        self.token_texts: dict[int, str | None] = {}
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams | PoolingParams, child_ids: list[str],
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        pooling = params if isinstance(params, PoolingParams) else None
        children = {}
        decode = pooling is None and params.detokenize
        for i, child_id in enumerate(child_ids):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params) if self.tokenizer and decode \
                else None
            children[child_id] = ChildState(i, detok, logprobs=[] if pooling is None and params.logprobs is not None
                                            else None, decode=decode)
            self.child_to_parent[child_id] = request_id
        self.parents[request_id] = ParentState(request_id, prompt, prompt_token_ids, children, output_kind,
                                               pooling=pooling)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.children) if parent else []

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    def process_outputs(self, outputs: list[EngineCoreOutput]
                        ) -> tuple[list[RequestOutput | EmbeddingRequestOutput], dict[str, str]]:
        """Returns the updated requests' outputs, each as its RequestOutputKind asks (a
        cumulative output copies the request's tokens, which a FINAL_ONLY or DELTA request
        never pays every step), and the children whose finish reason was decided here, with
        that reason: "stop" for a stop string, "error" when detokenizing raised. The caller
        ends them in the core (a no-op for those the core had ended too: a stop string
        completed by the last token) and counts them with this reason, the one the client sees."""
        touched: dict[str, ParentState] = {}
        stopped: dict[str, str] = {}
        embeddings: list[EmbeddingRequestOutput] = []
        for out in outputs:
            parent_id = self.child_to_parent.get(out.request_id)
            if parent_id is None:
                continue
            parent = self.parents[parent_id]
            child = parent.children[out.request_id]
            if child.finish_reason is not None:
                continue
            if out.pooled is not None:
                embeddings.append(self._embedding(parent, out.pooled))
                continue
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            if out.prompt_logprobs is not None and parent.prompt_logprobs is None:
                parent.prompt_logprobs = [None if lp is None else self._logprobs(lp, child.decode)
                                          for lp in out.prompt_logprobs]
            new_token_ids, new_logprobs = out.new_token_ids, out.new_logprobs
            child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
            if child.detokenizer is not None:
                try:
                    stop = child.detokenizer.update(new_token_ids, stop_terminated=out.finish_reason == "stop")
                except Exception:  # fail this request only, never the batch
                    logger.exception("detokenizing %s failed: it ends with finish_reason 'error'", out.request_id)
                    child.finish_reason, child.stop_reason, stop = "error", None, None
                    stopped[out.request_id] = "error"
                if stop is not None:  # as vLLM: a stop string is the reason, even where the core ended it too
                    (child.stop_reason, kept), child.finish_reason = stop, "stop"
                    new_token_ids, new_logprobs = new_token_ids[:kept], new_logprobs[:kept]
                    stopped[out.request_id] = "stop"
            child.token_ids.extend(new_token_ids)
            if child.logprobs is not None:
                sampled = [lp for lp in new_logprobs if lp is not None]
                child.logprobs.extend(self._logprobs(lp, child.decode) for lp in sampled)
                child.cumulative_logprob += sum(lp.logprob for lp in sampled)
            # An output says something new: a token, or an end (a FINAL_ONLY request has nothing to say until then).
            if child.finish_reason is not None or (new_token_ids and
                                                   parent.output_kind is not RequestOutputKind.FINAL_ONLY):
                touched[parent_id] = parent
        return embeddings + [self._make_output(p) for p in touched.values()
                             if p.output_kind is not RequestOutputKind.FINAL_ONLY or p.finished], stopped

    def _embedding(self, parent: ParentState, vector: list[float]) -> EmbeddingRequestOutput:
        """An embedding request's one output: the core's pooled vector, cut and normalized as it asked."""
        self._forget(parent)
        return EmbeddingRequestOutput(parent.request_id, parent.prompt_token_ids,
                                      EmbeddingOutput(self.pooler.finish(vector, parent.pooling)))

    def _forget(self, parent: ParentState) -> None:
        del self.parents[parent.request_id]
        for child_id in parent.children:
            self.child_to_parent.pop(child_id, None)

    def _logprobs(self, lp: TokenLogprobs, decode: bool) -> dict[int, Logprob]:
        """The token's Logprob, then the top-n alternatives' (ranked 1 to n), keyed by token id; each with its
        text if `decode` (the request's detokenize)."""
        text = self._token_text if decode else lambda token_id: None
        out = {lp.token_id: Logprob(lp.logprob, lp.rank, text(lp.token_id))}
        for rank, (token_id, value) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), 1):
            if token_id not in out:
                out[token_id] = Logprob(value, rank, text(token_id))
        return out

    def _token_text(self, token_id: int) -> str | None:
        text = self.token_texts.get(token_id)
        if text is None and self.tokenizer is not None:
            text = self.token_texts[token_id] = token_text(self.tokenizer, token_id)
        return text

    def abort(self, request_id: str) -> RequestOutput | None:
        """Mark every unfinished child aborted; returns the final output."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children.values():
            if child.finish_reason is None:
                child.finish_reason = "abort"
        return self._make_output(parent)

    def _make_output(self, parent: ParentState) -> RequestOutput:
        delta = parent.output_kind is RequestOutputKind.DELTA
        completions = []
        for child in parent.children.values():
            finished = child.finish_reason is not None
            if delta and len(child.token_ids) == child.num_sent and (not finished or child.finish_sent):
                continue  # n > 1: a child that did not step, or ended in an earlier output, has nothing new
            child.finish_sent = finished
            text = child.detokenizer.get_next_output_text(finished, delta) if child.detokenizer else ""
            start = child.num_sent if delta else 0
            logprobs = child.logprobs[start:] if child.logprobs is not None else None
            completions.append(CompletionOutput(child.index, text, child.token_ids[start:], logprobs,
                                                child.finish_reason, child.stop_reason,
                                                None if child.logprobs is None else child.cumulative_logprob))
            child.num_sent = len(child.token_ids)
        finished = parent.finished
        if finished:
            self._forget(parent)
        prompt_logprobs = None if delta and parent.prompt_logprobs_sent else parent.prompt_logprobs
        parent.prompt_logprobs_sent = parent.prompt_logprobs_sent or prompt_logprobs is not None
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, completions, finished,
                             parent.num_cached_tokens, prompt_logprobs)
