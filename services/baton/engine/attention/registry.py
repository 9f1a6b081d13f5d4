"""Attention backends by name."""

from __future__ import annotations

import torch

from baton.engine.attention.base import AttentionBackend
from baton.engine.config import ATTENTION_BACKENDS as BACKENDS


def make_attention_backend(name: str, device: torch.device, dtype: torch.dtype,
                           model_shape: tuple[int, int, int], cache_dir) -> AttentionBackend:
    """`model_shape` is (heads, kv heads, head dim); `cache_dir` holds built kernels."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_backend_available() else "torch"
    if name == "torch":
        from baton.engine.attention.torch_backend import TorchAttentionBackend

        native = prefill = None
        if device.type == "cpu":
            from baton.engine.attention import cpu_native, cpu_prefill

            native = cpu_native.load(cache_dir)
            if native is not None and not native.supports(dtype, *model_shape):
                native = None
            prefill = cpu_prefill.load(cache_dir)
            if prefill is not None and not prefill.supports(dtype, *model_shape):
                prefill = None
        return TorchAttentionBackend(dtype, native, prefill)
    if name == "triton":
        if not _triton_backend_available():
            raise ValueError("attention_backend='triton' needs the triton package "
                             "(pip install triton==3.9.0); use 'torch' or 'auto'")
        if device.type != "cuda" and not _interpreting():
            raise ValueError(f"attention_backend='triton' runs on CUDA; on {device.type} only "
                             "in Triton's interpreter (TRITON_INTERPRET=1, for tests): use "
                             "'torch' or 'auto'")
        from baton.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(dtype)
    raise ValueError(f"attention_backend={name!r} is unknown; choose one of {BACKENDS}")


def _triton_backend_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    from baton_kernels._common import interpreting

    return interpreting()
