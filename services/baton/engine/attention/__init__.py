"""Attention backends behind one interface: `torch` (CPU and fallback) and `triton` (GPU)."""

from baton.engine.attention.base import (
                                         AttentionBackend,
                                         BatchLayout,
                                         ForwardContext,
                                         LayerAttention,
)
from baton.engine.attention.selector import make_attention_backend

__all__ = ["AttentionBackend", "BatchLayout", "ForwardContext", "LayerAttention",
           "make_attention_backend"]
