"""The model shape, read from a Hugging Face `config.json`.

`ModelConfig` holds what the engine outside the model needs (sizes, heads, the attention
windows, the context length, EOS ids); an architecture's own settings (soft-caps, expert
counts, norms) are read by its module from `hf`, the raw config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from baton.engine.models.registry import SUPPORTED_ARCHITECTURES, architecture_of

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, object], ...] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...] = ()
    # Sliding-window attention: the window W (keys i - W < j <= i) of the layers whose
    # `layer_types` entry is SLIDING; None when no layer slides.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    hf: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False,
                                  repr=False)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, None for full attention."""
        if self.sliding_window is None or not self.layer_types:
            return None
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @property
    def all_sliding(self) -> bool:
        """Every layer slides (Mistral v0.1): blocks out of the window can be freed."""
        return (self.sliding_window is not None and bool(self.layer_types)
                and all(t == SLIDING for t in self.layer_types))

    @property
    def num_params(self) -> int:
        """Parameters, every expert of a mixture-of-experts model counted."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        o = self.num_heads * self.head_dim * h
        experts = self.hf.get("num_local_experts") or self.hf.get("num_experts") or 0
        dense = len(self.hf.get("mlp_only_layers") or ()) if experts else self.num_layers
        moe_i = self.hf.get("moe_intermediate_size") or i
        mlp = dense * 3 * h * i + (self.num_layers - dense) * experts * (3 * h * moe_i + h)
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * (qkv + o + 2 * h) + mlp + h + head

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        cfg = _text_config(cfg)
        arch = architecture_of(cfg)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"model architecture {arch!r} is not supported; supported: "
                             f"{sorted(SUPPORTED_ARCHITECTURES)}")
        rope = cfg.get("rope_parameters") or {}
        if isinstance(rope.get("full_attention"), dict):  # per layer type (Gemma 3)
            rope = rope["full_attention"]
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                              else None)
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        window, types = _attention_windows(cfg)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or 0,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=_frozen(scaling) if scaling else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
            sliding_window=window,
            layer_types=types,
            hf=MappingProxyType(dict(cfg)),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))


def _frozen(scaling: dict) -> tuple[tuple[str, object], ...]:
    """Hashable rope scaling: lists (longrope's factors) become tuples."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                        for k, v in scaling.items() if not isinstance(v, dict)))


def _text_config(cfg: dict) -> dict:
    """A multimodal wrapper's text model (Gemma 3's `text_config`), else `cfg` itself."""
    text = cfg.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" in text:
        merged = {**text}
        merged.setdefault("architectures", cfg.get("architectures"))
        for key in ("eos_token_id", "tie_word_embeddings"):
            if key in cfg and key not in text:
                merged[key] = cfg[key]
        return merged
    return cfg


# Configs without `layer_types` (older Gemma 2 / 3 on the Hub): every k-th layer global.
_GLOBAL_EVERY = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}


def _attention_windows(cfg: dict) -> tuple[int | None, tuple[str, ...]]:
    """(window, per-layer types) from `layer_types` where the config lists them, else from
    `sliding_window` (and Qwen2's `use_sliding_window` / `max_window_layers`)."""
    n = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        window = None
    types = cfg.get("layer_types")
    if window is None:
        return None, (FULL,) * n
    if types:
        types = tuple(SLIDING if t == SLIDING else FULL for t in types)
    elif "max_window_layers" in cfg:  # Qwen2: layers from max_window_layers on slide
        first = cfg["max_window_layers"]
        types = tuple(SLIDING if i >= first else FULL for i in range(n))
    elif architecture_of(cfg) in _GLOBAL_EVERY:  # older Gemma configs: every k-th is global
        k = cfg.get("sliding_window_pattern") or _GLOBAL_EVERY[architecture_of(cfg)]
        types = tuple(FULL if (i + 1) % k == 0 else SLIDING for i in range(n))
    else:
        types = (SLIDING,) * n
    if SLIDING not in types:
        return None, types
    return int(window), types
