"""Attention backends behind one interface: `torch` (CPU and fallback) and `triton` (GPU)."""

from baton.engine.attention.base import AttentionBackend, BatchLayout, ForwardContext
from baton.engine.attention.selector import make_attention_backend

__all__ = ["AttentionBackend", "BatchLayout", "ForwardContext", "make_attention_backend"]
