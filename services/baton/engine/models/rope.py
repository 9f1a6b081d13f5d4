"""Rotary position embeddings (Hugging Face's rotate-half layout), with Llama 3 and linear
scaling. Each step makes one StepRotary that every layer calls on its qkv rows: torch ops
over looked-up rows of the tables, or on CPU the native kernel (`cpu_ops.py`) reading the
tables by position."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from baton.engine.models.config import ModelConfig
from baton.engine.models.cpu_ops import CpuOps


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(cfg.rope_scaling or ())
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3)")


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for every position, looked up by the flat batch's positions."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(cfg)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        self.register_buffer("cos", emb.cos(), persistent=False)
        # rotate_half(x) * sin == swap_halves(x) * signed_sin: one op less per call.
        signed = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        self.register_buffer("signed_sin", signed, persistent=False)
        self._converted: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype):
        """(T,) positions -> cos, signed sin of shape (T, 1, D) in `dtype`."""
        return (self.cos.index_select(0, positions).to(dtype).unsqueeze(1),
                self.signed_sin.index_select(0, positions).to(dtype).unsqueeze(1))

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos, signed sin tables (P, D) in `dtype`, converted once per dtype."""
        if dtype == self.cos.dtype:
            return self.cos, self.signed_sin
        cached = self._converted.get(dtype)
        if cached is None or cached[0].device != self.cos.device:
            cached = self._converted[dtype] = (self.cos.to(dtype), self.signed_sin.to(dtype))
        return cached

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype,
                 native: CpuOps | None = None) -> StepRotary:
        """The rotation of one step's (T,) positions, for every layer's qkv; `native` (on
        CPU) reads the whole tables by position instead of looking them up here."""
        if native is not None:
            return StepRotary(positions, *self.tables(dtype), native)
        return StepRotary(positions, *self.lookup(positions, dtype), None)


@dataclass(frozen=True)
class StepRotary:
    """Rotates the q and k heads of qkv rows: `rope(qkv, H, KVH, D) -> q (T, H, D),
    k (T, KVH, D)`. cos / sin are (T, 1, D) rows for the torch path, or the (P, D) tables
    for the native kernel."""

    positions: torch.Tensor  # (T,) int64
    cos: torch.Tensor
    signed_sin: torch.Tensor
    native: CpuOps | None

    def __call__(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
        H, KVH, D = num_heads, num_kv_heads, head_dim
        if self.native is not None:
            return self.native.rotary(qkv, self.positions, self.cos, self.signed_sin, H, KVH, D)
        qk = apply_rotary(qkv[:, :(H + KVH) * D].view(-1, H + KVH, D), self.cos,
                          self.signed_sin)  # one call for q and k: (T, H + KVH, D)
        return qk.split([H, KVH], dim=1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, D) -> rotated copy (Hugging Face's rotate-half convention)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)
