"""LoRA adapters at the worker's edge: the `model` a request names resolved to the base model
or an adapter's host copy (off the event loop: a dropped copy is read again from disk),
run-time loads and unloads (vLLM's `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`,
read and built on a thread, never the engine's), the adapters' `/v1/models` cards with
their base as `parent`, and their counters on `/metrics`."""

from __future__ import annotations

from baton.common.errors import OpenAIError
from baton.common.lora_protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from baton.engine.lora import LoRAError, UnknownLoRAError
from baton.engine.lora.adapter import LoRAAdapter
from baton.engine.lora.registry import AdapterRegistry
from baton.worker.threads import on_a_thread_that_ends


class WorkerLoRA:
    """`registry`: the engine's adapters (None: started without LoRA); `base_names`: the
    served names of the base model (an adapter may not take one)."""

    def __init__(self, registry: AdapterRegistry | None, base_names: tuple[str, ...]) -> None:
        self.registry, self.base_names = registry, base_names

    def served(self, name: str) -> bool:
        """True for a base model name or a loaded adapter's."""
        return name in self.base_names or (self.registry is not None
                                           and name in self.registry.names())

    async def adapter_for(self, model: str) -> LoRAAdapter | None:
        """The adapter a request's `model` names (None: the base model); a 404 OpenAIError
        (model_not_found) for a name this worker does not serve."""
        if model in self.base_names:
            return None
        if self.registry is None:
            raise self.not_found(model)
        try:
            registry = self.registry  # a load may run torch's OpenMP regions: its own thread
            return await on_a_thread_that_ends(lambda: registry.get(model), background=True)
        except UnknownLoRAError:
            raise self.not_found(model) from None
        except LoRAError as err:  # its files changed or went away since it was loaded
            raise OpenAIError(500, str(err), param="model", code="lora_load_failed") from None

    def not_found(self, model: str) -> OpenAIError:
        served = ", ".join(repr(n) for n in (*self.base_names, *self.adapter_names()))
        return OpenAIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{served}", param="model", code="model_not_found")

    def adapter_names(self) -> list[str]:
        return self.registry.names() if self.registry is not None else []

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        """Load and serve an adapter; a 400 for a taken name, a worker without LoRA or an
        adapter that cannot be served (the message names why)."""
        registry = self._require_registry()
        if body.lora_name in self.base_names:
            raise OpenAIError(400, f"{body.lora_name!r} is the base model's name",
                              param="lora_name")
        try:
            await on_a_thread_that_ends(lambda: registry.add(body.lora_name, body.lora_path),
                                        background=True)
        except LoRAError as err:
            raise OpenAIError(400, str(err), param="lora_path") from None
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        """Stop serving an adapter (requests running with it finish); a 404 for one that
        is not loaded."""
        registry = self._require_registry()
        try:
            registry.remove(body.lora_name)
        except UnknownLoRAError as err:
            raise OpenAIError(404, str(err), param="lora_name", code="lora_not_found") from None
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    def _require_registry(self) -> AdapterRegistry:
        if self.registry is None:
            raise OpenAIError(400, "this worker serves no LoRA adapters; start it with "
                                   "--enable-lora or --lora-modules")
        return self.registry

    def model_cards(self, created: int, max_model_len: int) -> list[dict]:
        """`/v1/models` entries of the adapters, as vLLM lists them."""
        paths = self.registry.paths() if self.registry is not None else {}
        return [{"id": name, "object": "model", "created": created, "owned_by": "baton",
                 "root": path, "parent": self.base_names[0], "max_model_len": max_model_len}
                for name, path in paths.items()]
