"""The model runner's adapters: which adapter sits in which of the `max_loras` slots, loading one into a slot
when a step needs it (evicting the slot used least recently by a request), and each step's token -> slot
mapping. The scheduler guarantees a step never needs more adapters than there are slots; this class only
follows the step's requests (data plane, like the block table)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from nanoinfer.config import EngineConfig
from nanoinfer.distributed.parallel_state import tp_min
from nanoinfer.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear, shard_of
from nanoinfer.lora.adapter import LoRAAdapter
from nanoinfer.lora.layers import LoRASlots
from nanoinfer.lora.request import LoRARequest

logger = logging.getLogger("nanoinfer")

_Target = tuple[LinearBase, LoRASlots, int]  # the layer, its slots, the sub-projection


class LoRAModelManager:
    def __init__(self, model: nn.Module, hf_config: Any, config: EngineConfig, max_tokens: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        """Give every adaptable projection of `model` its slots (zero: no adapter yet)."""
        self.hf_config, self.max_rank, self.dtype = hf_config, config.max_lora_rank, dtype
        self.num_slots, self.max_cpu_loras = config.max_loras, config.max_cpu_loras or config.max_loras
        self.mapping = torch.zeros(max_tokens, self.num_slots, dtype=torch.bool, device=device)
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.slot_ids = torch.arange(self.num_slots, device=device)
        self.targets: dict[tuple[int, str], _Target] = {}
        self.slots: list[LoRASlots] = []
        for name, module in model.named_modules():
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or ".layers." not in name:
                continue
            layer, short = int(name.split(".layers.")[1].split(".")[0]), name.rsplit(".", 1)[1]
            subs = model.packed_modules_mapping.get(short, [(short, None)])
            if isinstance(module, RowParallelLinear):
                out_slices = [(0, module.weight.shape[0])]
            else:
                out_slices = [module.shard_range(shard_id) for _, shard_id in subs]
            module.lora = LoRASlots(module.weight.shape[1], out_slices, module.weight.shape[0], self.num_slots,
                                    self.max_rank, self.mapping, self.token_slots, dtype)
            self.slots.append(module.lora)
            for sub, (hf_name, _) in enumerate(subs):
                self.targets[(layer, hf_name)] = (module, module.lora, sub)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recently used first
        self.cpu_cache: OrderedDict[int, dict] = OrderedDict()  # lora_int_id -> its tensors (max_cpu_loras)

    def activate(self, loras: dict[int, LoRARequest]) -> tuple[dict[int, int], dict[int, str]]:
        """Put every adapter of the step in a slot: ({lora_int_id: slot}, {lora_int_id: why it failed to load})."""
        failed: dict[int, str] = {}
        for lora_id, request in loras.items():
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
                continue
            try:  # admission checked the folder; it changed since (the same checks run on what is read now)
                tensors, error = self._tensors(request), None
            except Exception as e:
                tensors, error = None, str(e)
            if tp_min(error is None) == 0:  # each TP rank reads the folder itself: all load it, or none does
                why = error or "another tensor-parallel rank could not load it"
                logger.warning("LoRA adapter %s (%s) could not be loaded: %s", request.lora_name, request.lora_path, why)
                failed[lora_id] = f"LoRA adapter {request.lora_name!r} could not be loaded: {why}"
                continue
            used = set(self.slot_of.values())
            free = [s for s in range(self.num_slots) if s not in used]
            if free:
                slot = free[0]
            else:  # the least recently used adapter this step does not need
                evicted = next(i for i in self.slot_of if i not in loras)
                slot = self.slot_of.pop(evicted)
            self._write(slot, tensors)
            self.slot_of[lora_id] = slot
        return {i: self.slot_of[i] for i in loras if i not in failed}, failed

    def _tensors(self, request: LoRARequest) -> dict:
        tensors = self.cpu_cache.get(request.lora_int_id)
        if tensors is None:
            tensors = LoRAAdapter.load(request.lora_path, self.hf_config, self.max_rank, self.dtype).weights
            self.cpu_cache[request.lora_int_id] = tensors
            while len(self.cpu_cache) > self.max_cpu_loras:
                self.cpu_cache.popitem(last=False)
        self.cpu_cache.move_to_end(request.lora_int_id)
        return tensors

    def _write(self, slot: int, tensors: dict) -> None:
        """This rank's shards of an adapter into `slot` of every layer. A column-parallel layer's input is the
        residual stream before its norm, whose weight g is folded into the layer's weight (layers/linear.py), so
        A is folded the same way: B A (g * x) = B (A g) x."""
        for slots in self.slots:
            slots.clear(slot)
        for (layer, module_name), (a, b) in tensors.items():
            module, slots, sub = self.targets[(layer, module_name)]
            if isinstance(module, RowParallelLinear):
                a = shard_of(a, 1, module.tp_rank, module.tp_size)
            else:
                if module.norm_weight is not None:
                    a = a * module.norm_weight.float().cpu()
                b = shard_of(b, 0, module.tp_rank, module.tp_size)
            slots.write(slot, sub, a, b)

    def set_mapping(self, token_slots: torch.Tensor) -> None:
        """The step's [tokens] slot per token (-1: the base model), and as the one-hot rows the PyTorch path reads."""
        tokens = token_slots.shape[0]
        self.token_slots[:tokens].copy_(token_slots)
        self.mapping[:tokens].copy_(token_slots[:, None] == self.slot_ids[None, :])
