"""Attention backends by name."""

from __future__ import annotations

import torch

from baton.engine.attention.base import AttentionBackend

BACKENDS = ("auto", "torch", "triton")


def make_attention_backend(name: str, device: torch.device, dtype: torch.dtype,
                           model_shape: tuple[int, int, int], cache_dir) -> AttentionBackend:
    """`model_shape` is (heads, kv heads, head dim); `cache_dir` holds built kernels."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_backend_available() else "torch"
    if name == "torch":
        from baton.engine.attention.torch_backend import TorchAttentionBackend

        native = None
        if device.type == "cpu":
            from baton.engine.attention import cpu_native

            native = cpu_native.load(cache_dir)
            if native is not None and not native.supports(dtype, *model_shape):
                native = None
        return TorchAttentionBackend(dtype, native)
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
