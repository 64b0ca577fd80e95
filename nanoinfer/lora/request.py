"""A request's adapter, named as vLLM names it: `LoRARequest(lora_name, lora_int_id, lora_path)`."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_int_id` (>= 1) identifies the adapter in the engine: its slots, and its requests' prefix-cache
    blocks, which are never shared with other adapters or the base model. One id stands for one adapter: the
    engine refuses the same id with another name or path."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None  # (vLLM's field: the model it was trained on; informational)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty str, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or \
                not 1 <= self.lora_int_id < 2**63:
            raise ValueError(f"lora_int_id must be an integer >= 1 (0 is the base model), got {self.lora_int_id!r}")
        if isinstance(self.lora_path, os.PathLike):
            object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must name the adapter's folder (adapter_config.json and "
                             f"adapter_model.safetensors), got {self.lora_path!r}")
