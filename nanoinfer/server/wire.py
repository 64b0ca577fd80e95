"""What travels between the API process and the engine-core process: msgpack
frames of `[MessageType, ...]`. Plain lists and dicts only, so either side
can be read without the other's classes and nothing is ever unpickled."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import msgpack

from nanoinfer.lora.request import LoRARequest
from nanoinfer.outputs import EngineCoreOutput, TokenLogprobs
from nanoinfer.request import Request
from nanoinfer.sampling_params import SamplingParams


class MessageType(enum.IntEnum):
    # API -> core
    ADD = 0  # [ADD, request dict]
    ABORT = 1  # [ABORT, child ids, RequestStatus]: client gone, stop string, shutdown
    SHUTDOWN = 2  # [SHUTDOWN]
    # core -> API
    READY = 3  # [READY, EngineLimits as a dict, number of KV blocks]
    OUTPUTS = 4  # [OUTPUTS, outputs, [[child id, queue seconds], ...], stats dict]
    ERROR = 5  # [ERROR, message]: the core is about to exit


def pack(*frame: Any) -> bytes:
    return msgpack.packb(frame, use_bin_type=True)


def unpack(data: bytes) -> list:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def encode_request(request: Request) -> dict:
    return {
        "request_id": request.request_id,
        "prompt_token_ids": request.prompt_token_ids,
        # (output_kind is the API process's business: the core gives every request's new tokens each step)
        "sampling_params": {k: v for k, v in dataclasses.asdict(request.sampling_params).items() if k != "output_kind"},
        "max_tokens": request.max_tokens,
        "priority": request.priority,
        "cache_salt": request.cache_salt,
        "arrival_time": request.arrival_time,  # time.monotonic(): one clock for all processes on a host
        "lora_request": None if request.lora_request is None else dataclasses.asdict(request.lora_request),
    }


def decode_request(data: dict, eos_token_ids: set[int], block_size: int) -> Request:
    """The core's copy of a request the API process validated; the core's own limits fill in the rest."""
    lora = data["lora_request"]
    return Request(data["request_id"], data["prompt_token_ids"], SamplingParams(**data["sampling_params"]),
                   eos_token_ids, block_size, data["max_tokens"], data["priority"], data["cache_salt"],
                   data["arrival_time"], lora and LoRARequest(**lora))


def _encode_logprobs(logprobs: list[TokenLogprobs | None] | None) -> list | None:
    if logprobs is None:
        return None
    return [None if lp is None else [lp.token_id, lp.logprob, lp.rank, lp.top_token_ids, lp.top_logprobs]
            for lp in logprobs]


def _decode_logprobs(rows: list | None) -> list[TokenLogprobs | None] | None:
    return None if rows is None else [None if lp is None else TokenLogprobs(*lp) for lp in rows]


def encode_outputs(outputs: list[EngineCoreOutput]) -> list[list]:
    return [[o.request_id, o.new_token_ids,
             None if all(lp is None for lp in o.new_logprobs) else _encode_logprobs(o.new_logprobs),
             o.finish_reason, o.stop_reason, o.num_cached_tokens, _encode_logprobs(o.prompt_logprobs), o.pooled]
            for o in outputs]


def decode_outputs(rows: list[list]) -> list[EngineCoreOutput]:
    outputs = []
    for request_id, token_ids, logprobs, finish_reason, stop_reason, num_cached, prompt_logprobs, pooled in rows:
        new_logprobs = _decode_logprobs(logprobs) or [None] * len(token_ids)
        outputs.append(EngineCoreOutput(request_id, token_ids, new_logprobs, finish_reason, stop_reason, num_cached,
                                        _decode_logprobs(prompt_logprobs), pooled))
    return outputs
