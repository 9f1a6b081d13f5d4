"""Attention backends by name."""

from __future__ import annotations

import torch

from baton.engine.attention.base import AttentionBackend

BACKENDS = ("auto", "torch", "triton")


def make_attention_backend(name: str, device: torch.device,
                           dtype: torch.dtype) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_backend_available() else "torch"
    if name == "torch":
        from baton.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(dtype)
    if name == "triton":
        if not _triton_backend_available():
            raise ValueError("attention_backend='triton' is not available in this build; "
                             "use 'torch' or 'auto'")
        from baton.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(dtype)
    raise ValueError(f"attention_backend={name!r} is unknown; choose one of {BACKENDS}")


def _triton_backend_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("baton.engine.attention.triton_backend") is not None
