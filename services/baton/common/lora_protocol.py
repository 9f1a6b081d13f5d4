"""vLLM's run-time LoRA endpoints' bodies (no torch): `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter`."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from baton.common.request_model import RequestModel

Name = Annotated[str, Field(min_length=1, max_length=128)]


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: Name
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: Name
    lora_int_id: int | None = None  # vLLM's; the name alone identifies an adapter here
