"""The names a request's `model` may take, as vLLM's OpenAIServingModels: the base model's served names (no
adapter) and the LoRA adapters, given at start-up (--lora-modules) or loaded at run time (/v1/load_lora_adapter,
when VLLM_ALLOW_RUNTIME_LORA_UPDATING is set). Each adapter gets an id of its own, never reused: the id keys its
requests' prefix-cache blocks and its slot in the model runner, so a name loaded again after an unload (perhaps
from another folder) never meets the old adapter's blocks."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import Iterable

from nanoinfer.lora.request import LoRARequest
from nanoinfer.server.cli import LoRAModulePath
from nanoinfer.server.core_client import CoreClient
from nanoinfer.server.protocol import ApiError, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

logger = logging.getLogger("nanoinfer")


def runtime_lora_updating(enable_lora: bool) -> bool:
    """Whether to serve /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING
    on a server with --enable-lora. They let a client make the server read a folder of its choosing, so they exist
    only where the operator asks for them."""
    if os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() not in ("1", "true"):
        return False
    if not enable_lora:
        logger.warning("VLLM_ALLOW_RUNTIME_LORA_UPDATING is set, but the server has no --enable-lora: LoRA adapters "
                       "cannot be loaded")
        return False
    logger.warning("VLLM_ALLOW_RUNTIME_LORA_UPDATING is set: clients may load LoRA adapters from this machine's "
                   "folders (/v1/load_lora_adapter) and unload them")
    return True


class OpenAIServingModels:
    def __init__(self, client: CoreClient, base_model_names: Iterable[str],
                 lora_modules: tuple[LoRAModulePath, ...] = ()) -> None:
        """The adapters of `lora_modules` get ids 1, 2, ...; their folders are checked as the client starts
        (`client.start(models.lora_requests.values())`). ValueError for adapters on an engine without enable_lora,
        or a name given twice."""
        self.client = client
        self.base_model_names = list(base_model_names)
        self.lora_requests: dict[str, LoRARequest] = {}  # by name
        self._ids = itertools.count(1)
        self._loading = asyncio.Lock()  # one load at a time: its name is checked and taken without a race
        if lora_modules and not client.config.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora: the engine serves LoRA adapters only when started "
                             "with it")
        for module in lora_modules:
            self.lora_requests[module.name] = self._new_request(module.name, module.path, module.base_model_name)

    def _new_request(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """An adapter under a fresh id; ValueError for a name this server already serves. Its parent in /v1/models
        is `base_model_name` where that is a served name (vLLM ignores others), else the first served name."""
        if name in self.lora_requests:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")  # (vLLM's words)
        if name in self.base_model_names:
            raise ValueError(f"{name!r} is the base model's served name; a LoRA adapter needs a name of its own")
        parent = base_model_name if base_model_name in self.base_model_names else None
        return LoRARequest(name, next(self._ids), path, parent)

    def lora_request(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); a 404 for a name this server does not
        serve (omitting `model` is fine)."""
        if name is None or name in self.base_model_names:
            return None
        lora = self.lora_requests.get(name)
        if lora is None:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                                f"{self.base_model_names + list(self.lora_requests)}", "model")
        return lora

    def show_available_models(self) -> dict:
        """/v1/models: the base model's names, then the adapters, each with its base model as `parent` (vLLM's)."""
        card = {"object": "model", "created": int(time.time()), "owned_by": "nanoinfer"}
        max_model_len = self.client.limits.max_tokens_per_request
        return {"object": "list", "data": [
            {"id": name} | card | {"root": self.client.model_path, "max_model_len": max_model_len}
            for name in self.base_model_names] + [
            {"id": name} | card | {"root": lora.lora_path, "parent": lora.base_model_name or self.base_model_names[0],
                                   "max_model_len": max_model_len}
            for name, lora in self.lora_requests.items()]}

    async def load_lora_adapter(self, req: LoadLoRAAdapterRequest) -> str:
        """Serve a new adapter once its folder is checked (off the event loop: it reads files); 400 with the
        reason otherwise."""
        async with self._loading:
            try:
                lora = self._new_request(req.lora_name, req.lora_path)
            except ValueError as e:
                raise ApiError(400, str(e), "lora_name") from None
            try:
                await asyncio.to_thread(self.client.loras.check, lora)
            except ValueError as e:
                raise ApiError(400, str(e), "lora_path") from None
            self.lora_requests[lora.lora_name] = lora
        logger.info("loaded LoRA adapter %r from %s (id %d)", lora.lora_name, lora.lora_path, lora.lora_int_id)
        return f"Success: LoRA adapter '{lora.lora_name}' added successfully."

    def unload_lora_adapter(self, req: UnloadLoRAAdapterRequest) -> str:
        """Stop serving an adapter: new requests naming it get 404; those in flight finish with it."""
        lora = self.lora_requests.pop(req.lora_name, None)
        if lora is None:
            raise ApiError(404, f"The lora adapter '{req.lora_name}' cannot be found.", "lora_name")
        self.client.loras.forget(lora.lora_int_id)  # (admission's record: its id is never used again)
        logger.info("unloaded LoRA adapter %r", req.lora_name)
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
