"""LoRA adapters served beside the base model (vLLM's multi-LoRA): a request names an adapter with a
`LoRARequest`; the scheduler keeps at most `max_loras` adapters in a step, and the model runner holds them in
`max_loras` slots of every linear layer it adapts, so requests of different adapters (and of none) share one
forward pass."""

from nanoinfer.lora.request import LoRARequest

__all__ = ["LoRARequest"]
