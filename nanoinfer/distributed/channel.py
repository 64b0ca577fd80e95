"""Rank 0 -> every rank: one pickled Python object per message, broadcast as a
byte tensor on the gloo control group. It never touches the GPU and works
across hosts; messages are small (a step's SchedulerOutput delta).

Each message is one fixed-size broadcast (the length, then the first bytes),
plus a second one only for the rest of a message longer than that: a decode
step's delta fits in the first, so a step costs one round on the network."""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

HEAD_BYTES = 16 << 10
_LENGTH_BYTES = 8


class BroadcastChannel:
    def __init__(self, group: dist.ProcessGroup, src: int = 0) -> None:
        self.group, self.src = group, src

    def send(self, obj: Any) -> None:
        """Rank `src` only."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        inline = HEAD_BYTES - _LENGTH_BYTES
        head = bytearray(HEAD_BYTES)
        head[:_LENGTH_BYTES] = len(payload).to_bytes(_LENGTH_BYTES, "little")
        head[_LENGTH_BYTES : _LENGTH_BYTES + min(len(payload), inline)] = payload[:inline]
        dist.broadcast(torch.frombuffer(head, dtype=torch.uint8), self.src, group=self.group)
        if len(payload) > inline:
            dist.broadcast(torch.frombuffer(bytearray(payload[inline:]), dtype=torch.uint8), self.src, group=self.group)

    def recv(self) -> Any:
        """Every other rank: blocks until `src` sends."""
        head = torch.empty(HEAD_BYTES, dtype=torch.uint8)
        dist.broadcast(head, self.src, group=self.group)
        data = head.numpy().tobytes()
        length = int.from_bytes(data[:_LENGTH_BYTES], "little")
        payload = data[_LENGTH_BYTES : _LENGTH_BYTES + length]
        if length > len(payload):
            rest = torch.empty(length - len(payload), dtype=torch.uint8)
            dist.broadcast(rest, self.src, group=self.group)
            payload += rest.numpy().tobytes()
        return pickle.loads(payload)
