"""Rotary position embeddings (Hugging Face's rotate-half layout) and every scaling Hugging
Face checkpoints use: default, linear, dynamic (NTK), llama3, yarn, longrope (legacy "su").
Each step makes one StepRotary that every layer calls on its qkv rows: torch ops over
looked-up rows of the tables, or a fused kernel reading the tables by position where the
platform gave the table one (`kernel`: on CPU, `baton_cpu.ops`).

The tables hold, for every position p < max_positions, cos and sin of p's angles, already
multiplied by the scaling's attention factor (yarn's mscale, longrope's factor): Hugging Face
multiplies cos / sin by it, and a fused kernel reads only the tables.

What a paged KV cache can honour. A key is rotated once, when its position is computed, and
then shared through the prefix cache, so a position's rotation must depend on the position
alone, never on how long its sequence later grows. Hugging Face's two length-dependent
scalings are therefore fixed per position (row p of the table):
- dynamic: the frequencies Hugging Face computes for a sequence ending at p, i.e. for
  seq_len = max(p + 1, max_position_embeddings). Positions inside max_position_embeddings
  get the unscaled frequencies, exactly as Hugging Face; a position beyond gets what Hugging
  Face's `generate` gives the token decoded there (its cache keeps the older keys' rotations
  too). Only a single forward over a prompt longer than max_position_embeddings differs
  (Hugging Face then rotates every token with the last position's frequencies). vLLM instead
  scales every position for the longest context, which differs from Hugging Face everywhere.
- longrope: short factors below original_max_position_embeddings, long factors from there
  on (vLLM's per-position choice). Identical to Hugging Face for sequences that stay within
  original_max_position_embeddings; a longer one Hugging Face recomputes whole with the long
  factors (Phi-3's `prepare_inputs_for_generation` drops its cache), which no prefix cache
  can follow.
yarn, llama3 and linear do not depend on the length: exact at every position.

Partial rotary (`partial_rotary_factor`, Phi-4-mini): Hugging Face rotates the first r dims
of each head (pairs (i, i + r/2)) and passes the rest through. The tables here always span
the whole head with rotate-half pairs (i, i + D/2); the dims past the rotated ones get angle
0 (cos 1, sin 0: passed through exactly). A model with partial rotary permutes its q / k
projection rows at load with `partial_rotary_order` so that Hugging Face's pairs land on
ours; q . k is unchanged by permuting both, so attention computes exactly the same thing
and every rotary path (torch, fused kernel, one-call CPU decode) stays one code path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from baton.engine.models.config import ModelConfig

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
_ALIASES = {"su": "longrope"}  # Phi-3's first configs


def rope_parameters(cfg: ModelConfig) -> dict:
    """The scaling's parameters (Hugging Face `rope_scaling` / `rope_parameters`), with
    `rope_type` resolved and `original_max_position_embeddings` as Hugging Face resolves it
    (a top-level value first: Phi-3 keeps it there)."""
    params: dict[str, Any] = dict(cfg.rope_scaling or ())
    kind = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = _ALIASES.get(kind, kind)
    if params["rope_type"] not in ROPE_TYPES:
        raise ValueError(f"rope scaling type {kind!r} is not supported; supported: "
                         f"{', '.join(ROPE_TYPES)}")
    top = cfg.hf.get("original_max_position_embeddings")
    if top is not None:
        params["original_max_position_embeddings"] = top
    params.setdefault("original_max_position_embeddings", cfg.max_position_embeddings)
    return params


def rotary_dim(cfg: ModelConfig) -> int:
    """How many dims of each head are rotated: head_dim * partial_rotary_factor."""
    rope = cfg.hf.get("rope_parameters")
    # Any: a value of the checkpoint's JSON config, checked by the float() below
    factor: Any = dict(cfg.rope_scaling or ()).get("partial_rotary_factor")
    if factor is None and isinstance(rope, dict):
        factor = rope.get("partial_rotary_factor")
    if factor is None:
        factor = cfg.hf.get("partial_rotary_factor", 1.0)
    dim = int(cfg.head_dim * float(factor))
    if dim % 2 or dim <= 0 or (cfg.head_dim - dim) % 2:
        raise ValueError(f"partial_rotary_factor={factor} gives {dim} rotated dims of a "
                         f"{cfg.head_dim}-dim head; both counts must be even")
    return dim


def inverse_frequencies(cfg: ModelConfig, seq_len: int | None = None) -> torch.Tensor:
    """(rotary_dim / 2,) float32 inverse frequencies, as Hugging Face's rope init function
    computes them for a sequence of `seq_len` tokens (only dynamic and longrope read it;
    None: their values at initialisation)."""
    params = rope_parameters(cfg)
    kind, dim = params["rope_type"], rotary_dim(cfg)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # (dim / 2,)
    if kind == "dynamic" and seq_len is not None and seq_len > cfg.max_position_embeddings:
        return _dynamic(cfg, float(params["factor"]), exponents, dim, torch.tensor([seq_len]))[0]
    if kind == "longrope":
        orig = params["original_max_position_embeddings"]
        long = seq_len is not None and seq_len > orig
        ext = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * cfg.rope_theta ** exponents)
    if kind == "yarn":
        return _yarn(cfg, params, exponents, dim)
    inv_freq = 1.0 / (cfg.rope_theta ** exponents)
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        return _llama3(inv_freq, params)
    return inv_freq


def attention_factor(cfg: ModelConfig) -> float:
    """What Hugging Face multiplies cos and sin by (1.0 but for yarn and longrope)."""
    params = rope_parameters(cfg)
    kind, given = params["rope_type"], params.get("attention_factor")
    if kind not in ("yarn", "longrope") or given is not None:
        return 1.0 if given is None else float(given)
    orig = params["original_max_position_embeddings"]
    factor = params.get("factor") or cfg.max_position_embeddings / orig
    if kind == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def context_limit(cfg: ModelConfig) -> int:
    """The longest context the rope scaling supports: dynamic NTK scales past
    max_position_embeddings by its factor, yarn reaches original * factor (Qwen's configs
    keep max_position_embeddings at the original length); others stop at
    max_position_embeddings (longrope's and llama3's configs already give the long one)."""
    params = rope_parameters(cfg)
    kind, mpe = params["rope_type"], cfg.max_position_embeddings
    if kind == "dynamic":
        return int(mpe * float(params["factor"]))
    if kind == "yarn" and params.get("factor"):
        return max(mpe, int(params["original_max_position_embeddings"] * float(params["factor"])))
    return mpe


def _dynamic(cfg: ModelConfig, factor: float, exponents: torch.Tensor, dim: int,
             lengths: torch.Tensor) -> torch.Tensor:
    """(N,) int64 sequence lengths, each > max_position_embeddings -> (N, dim / 2)
    frequencies, in float32 tensor arithmetic as Hugging Face's update at run time."""
    mpe = cfg.max_position_embeddings
    base = cfg.rope_theta * ((factor * lengths / mpe) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base[:, None] ** exponents)


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(cfg: ModelConfig, s: dict, exponents: torch.Tensor, dim: int) -> torch.Tensor:
    """YaRN: interpolated (divided by factor) low frequencies, extrapolated (kept) high
    ones, a linear ramp between the dims that turn beta_slow and beta_fast times over the
    original context."""
    base, orig = cfg.rope_theta, s["original_max_position_embeddings"]
    factor = float(s.get("factor") or cfg.max_position_embeddings / orig)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_turning(rotations: float) -> float:  # the dim that turns `rotations` times
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_turning(beta_fast), dim_turning(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no empty ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** exponents
    keep = 1 - ramp  # (dim / 2,) weight of the extrapolated (unscaled) frequency
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def position_angles(cfg: ModelConfig, max_positions: int) -> torch.Tensor:
    """(P, rotary_dim / 2) float32 angles of positions 0..P-1, fixed per position as the
    module docstring says for the length-dependent scalings."""
    params = rope_parameters(cfg)
    pos = torch.arange(max_positions, dtype=torch.float32)  # (P,)
    if params["rope_type"] == "longrope":  # short factors below orig, long from there on
        orig = params["original_max_position_embeddings"]
        short = torch.outer(pos[:orig], inverse_frequencies(cfg))
        long = torch.outer(pos[orig:], inverse_frequencies(cfg, seq_len=orig + 1))
        return torch.cat((short, long))
    if params["rope_type"] == "dynamic":  # row p: the frequencies of p + 1 tokens
        mpe, dim = cfg.max_position_embeddings, rotary_dim(cfg)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        lengths = torch.arange(mpe + 1, max_positions + 1, dtype=torch.int64)  # (P - mpe,)
        scaled = _dynamic(cfg, float(params["factor"]), exponents, dim, lengths)
        return torch.cat((torch.outer(pos[:mpe], inverse_frequencies(cfg)),
                          pos[mpe:, None] * scaled))
    return torch.outer(pos, inverse_frequencies(cfg))


def partial_rotary_order(head_dim: int, rotated: int) -> torch.Tensor:
    """(D,) index: our head dim j holds Hugging Face's dim order[j], so that its rotated
    pairs (i, i + r/2) become ours (i, i + D/2) and its passed-through dims pair among
    themselves at angle 0. Identity when the whole head rotates."""
    half, rest = rotated // 2, (head_dim - rotated) // 2
    first = torch.cat((torch.arange(0, half), torch.arange(rotated, rotated + rest)))
    second = torch.cat((torch.arange(half, rotated), torch.arange(rotated + rest, head_dim)))
    return torch.cat((first, second))


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for every position, looked up by the flat batch's positions."""

    cos: torch.Tensor  # buffers (register_buffer), declared for the type checker
    signed_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        angles = position_angles(cfg, max_positions)  # (P, r/2)
        scale = attention_factor(cfg)
        cos, sin = angles.cos() * scale, angles.sin() * scale  # (P, r/2), as HF scales them
        passed = (cfg.head_dim - 2 * angles.shape[1]) // 2  # partial rotary: angle-0 pairs
        if passed:
            cos = torch.cat((cos, torch.ones(max_positions, passed)), dim=-1)  # (P, D/2)
            sin = torch.cat((sin, torch.zeros(max_positions, passed)), dim=-1)
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)  # (P, D)
        # rotate_half(x) * sin == swap_halves(x) * signed_sin: one op less per call.
        self.register_buffer("signed_sin", torch.cat((-sin, sin), dim=-1), persistent=False)
        self._converted: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self.kernel: RotaryKernel | None = None  # set by the platform (`platforms/cpu.py`)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
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

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRotary:
        """The rotation of one step's (T,) positions, for every layer's qkv; a `kernel`
        reads the whole tables by position instead of rows looked up here."""
        if self.kernel is not None:
            return StepRotary(positions, *self.tables(dtype), self.kernel)
        return StepRotary(positions, *self.lookup(positions, dtype), None)


class RotaryKernel(Protocol):
    """A fused rotary (`baton_cpu.ops.CpuOps.rotary`): qkv rows, (T,) positions, the (P, D)
    tables in qkv's dtype -> q (T, H, D), k (T, KVH, D)."""

    def rotary(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               signed_sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
               ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class StepRotary:
    """Rotates the q and k heads of qkv rows: `rope(qkv, H, KVH, D) -> q (T, H, D),
    k (T, KVH, D)`. cos / sin are (T, 1, D) rows for the torch path, or the (P, D) tables
    for a kernel."""

    positions: torch.Tensor  # (T,) int64
    cos: torch.Tensor
    signed_sin: torch.Tensor
    kernel: RotaryKernel | None

    def __call__(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
        H, KVH, D = num_heads, num_kv_heads, head_dim
        if self.kernel is not None:
            return self.kernel.rotary(qkv, self.positions, self.cos, self.signed_sin, H, KVH, D)
        qk = apply_rotary(qkv[:, :(H + KVH) * D].view(-1, H + KVH, D), self.cos,
                          self.signed_sin)  # one call for q and k: (T, H + KVH, D)
        return qk.split([H, KVH], dim=1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, D) -> rotated copy (Hugging Face's rotate-half convention)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)
