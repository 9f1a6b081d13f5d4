"""Picks the attention backend for an engine: `auto` is `triton` on CUDA (when the triton
package is installed) and `torch` elsewhere; on CPU the `torch` backend gets `baton_cpu`'s
paged attention kernels when they build and support the model's shape."""

from __future__ import annotations

import torch

from baton.engine.attention.base import AttentionBackend
from baton.engine.config import ATTENTION_BACKENDS as BACKENDS


def make_attention_backend(name: str, device: torch.device, dtype: torch.dtype,
                           model_shape: tuple[int, int, int], cache_dir,
                           deterministic: bool = False) -> AttentionBackend:
    """A new backend for `name` (one of `ATTENTION_BACKENDS`) on `device`.

    `model_shape` is (heads, kv heads, head dim); `cache_dir` is where the CPU kernels are
    built and cached (`torch` on CPU) and where `triton` keeps Triton's compiled kernels
    (`<cache_dir>/triton` as TRITON_CACHE_DIR unless that is set; None: Triton's default).
    Called once per `ModelRunner`, on the thread that builds it. Raises ValueError for an unknown name, or for `triton` without
    the triton package or off CUDA (outside Triton's interpreter); the message says which
    backend to use instead. `deterministic` asks for batch-invariant attention: the `torch`
    backend on CPU with its C decode kernel for every query token (ValueError otherwise).
    """
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_backend_available() else "torch"
    if deterministic:
        return _per_token_backend(name, device, dtype, model_shape, cache_dir)
    if name == "torch":
        return _torch_backend(device, dtype, model_shape, cache_dir)
    if name == "triton":
        if not _triton_backend_available():
            raise ValueError("attention_backend='triton' needs the triton package "
                             "(pip install triton==3.7.1, the gpu extra); use 'torch' or 'auto'")
        if device.type != "cuda" and not _interpreting():
            raise ValueError(f"attention_backend='triton' runs on CUDA; on {device.type} only "
                             "in Triton's interpreter (TRITON_INTERPRET=1, for tests): use "
                             "'torch' or 'auto'")
        from baton.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(dtype, cache_dir)
    raise ValueError(f"attention_backend={name!r} is unknown; choose one of {BACKENDS}")


def _torch_backend(device: torch.device, dtype: torch.dtype,
                   model_shape: tuple[int, int, int], cache_dir,
                   per_token: bool = False) -> AttentionBackend:
    """The `torch` backend; on CPU with the C kernels that built and fit the shape (a kernel
    that did not is None: the backend falls back to its torch code)."""
    from baton.engine.attention.torch_backend import TorchAttentionBackend

    native = prefill = None
    if device.type == "cpu":
        from baton_cpu import attention

        native = attention.load_decode(cache_dir)
        if native is not None and not native.supports(dtype, *model_shape):
            native = None
        prefill = attention.load_prefill(cache_dir)
        if prefill is not None and not prefill.supports(dtype, *model_shape):
            prefill = None
    return TorchAttentionBackend(dtype, native, prefill, per_token)


def _per_token_backend(name: str, device: torch.device, dtype: torch.dtype,
                       model_shape: tuple[int, int, int], cache_dir) -> AttentionBackend:
    """Deterministic mode's attention: every query token, prefill or decode, through the C
    decode kernel over its own context, so its result cannot depend on the chunk or the
    batch around it."""
    if name != "torch" or device.type != "cpu":
        raise ValueError(f"deterministic mode attends with the torch backend on CPU (not "
                         f"{name!r} on {device.type})")
    return _torch_backend(device, dtype, model_shape, cache_dir, per_token=True)


def _triton_backend_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    from baton_kernels._common import interpreting

    return interpreting()
