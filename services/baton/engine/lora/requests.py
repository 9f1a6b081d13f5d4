"""What the engine checks of a request's adapter."""

from __future__ import annotations

from typing import TYPE_CHECKING

from baton.engine.errors import InvalidRequestError
from baton.engine.lora.adapter import LoRAAdapter

if TYPE_CHECKING:
    from baton.engine.kv_connector.handoff import KVHandoff
    from baton.engine.lora.manager import LoRAManager
    from baton.engine.lora.registry import AdapterRegistry

__all__ = ["LoRAAdapter", "check_lora_request", "lora_registry"]


def lora_registry(manager: LoRAManager | None) -> AdapterRegistry:
    """The engine's adapters; ValueError when it serves none."""
    if manager is None:
        raise ValueError("this engine serves no LoRA adapters; start it with enable_lora=True "
                         "(--enable-lora) or lora_modules (--lora-modules)")
    return manager.registry


def check_lora_request(lora: LoRAAdapter | None, kv: KVHandoff | None,
                       manager: LoRAManager | None) -> LoRAAdapter | None:
    """`lora` if this engine can run a request with it; InvalidRequestError (param `model`)
    when the engine serves no adapters. A prefill / decode hand-over (`kv`) needs nothing
    more: both pods apply the adapter the request names, and the pulled blocks' hashes
    chain from its root on the decode pod too."""
    if lora is None:
        return None
    if manager is None:
        raise InvalidRequestError(f"this engine serves no LoRA adapters (asked for "
                                  f"{lora.name!r}); start it with --enable-lora",
                                  param="model")
    return lora
