"""Rank 0 -> every rank: one pickled Python object per message, broadcast as a
byte tensor on the gloo control group. It never touches the GPU and works
across hosts; messages are small (a step's SchedulerOutput delta)."""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist


class BroadcastChannel:
    def __init__(self, group: dist.ProcessGroup, src: int = 0) -> None:
        self.group, self.src = group, src

    def send(self, obj: Any) -> None:
        """Rank `src` only. The size goes first so receivers can allocate the payload."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        dist.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), self.src, group=self.group)
        dist.broadcast(payload, self.src, group=self.group)

    def recv(self) -> Any:
        """Every other rank: blocks until `src` sends."""
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, self.src, group=self.group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, self.src, group=self.group)
        return pickle.loads(payload.numpy().tobytes())
