"""The attention backend contract.

The model runner builds one `BatchLayout` per step (sequences ordered decodes first, then
prefill chunks) and asks the backend for its metadata once; every layer then calls
`forward`, which writes the step's new K/V into that layer's paged cache and returns the
attention output. Called only from the engine loop thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

Meta = TypeVar("Meta")  # a backend's per-step metadata (its build_metadata result)


@dataclass
class BatchLayout:
    """Where each sequence of the flat batch lives.

    Sequence i owns query tokens [query_start_loc[i], query_start_loc[i+1]); its first
    context_lens[i] tokens are already cached and seq_lens[i] = context + query. The first
    `num_decodes` sequences have exactly one query token.
    """

    query_start_loc: list[int]
    context_lens: list[int]
    seq_lens: list[int]
    num_decodes: int
    block_tables: torch.Tensor  # (B, max_blocks) int64, rows padded with block 0
    slot_mapping: torch.Tensor  # (T,) int64, -1 = do not write
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_decode_tokens(self) -> int:
        return self.query_start_loc[self.num_decodes]

    def rows_as_decodes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every query row as a decode of its own: (T, max_blocks) block tables (its
        sequence's row) and (T,) int64 lengths — row r of sequence i, at position p, attends
        the first p + 1 tokens of i's blocks (its own K/V written before: causal by
        length). For kernels of one query token per sequence (deterministic mode's
        attention)."""
        seq_of_row: list[int] = []
        lens: list[int] = []
        for i in range(self.num_seqs):
            count = self.query_start_loc[i + 1] - self.query_start_loc[i]
            seq_of_row += [i] * count
            lens += range(self.seq_lens[i] - count + 1, self.seq_lens[i] + 1)
        rows = torch.tensor(seq_of_row, dtype=torch.int64, device=self.block_tables.device)
        return (self.block_tables.index_select(0, rows).contiguous(),
                torch.tensor(lens, dtype=torch.int64))


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends: `scale` multiplies q.k; `sliding_window` W (None: every
    earlier key) lets query position i see keys i - W < j <= i; `softcap` c (None: off)
    turns scores s into c * tanh(s / c) before the softmax (Gemma 2). `k_scale` /
    `v_scale`: the layer's FP8 KV cache scales (stored = x / scale; `kv_quant`), 1.0 for
    any other cache dtype."""

    scale: float
    sliding_window: int | None = None
    softcap: float | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def plain(self) -> bool:
        """Full causal attention, no soft-capping: what every kernel implements."""
        return self.sliding_window is None and self.softcap is None


class AttentionBackend(ABC, Generic[Meta]):
    name: str

    @abstractmethod
    def build_metadata(self, layout: BatchLayout) -> Meta:
        """Per-step precomputation shared by all layers (masks, gather indices)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: Meta,
                spec: LayerAttention | None = None) -> torch.Tensor:
        """q (T, H, D), k/v (T, KVH, D); caches (num_blocks, block_size, KVH, D).

        Writes k/v into the caches at the layout's slot mapping (mutates the caches), then
        returns (T, H, D): each query attends causally to its sequence's cached prefix and
        to the step's tokens up to itself, as `spec` says (scale, window, soft-cap; None:
        full causal attention scaled by D ** -0.5).
        """


@dataclass
class ForwardContext:
    """What one forward pass needs beyond token ids and positions; passed down explicitly."""

    backend: AttentionBackend[Any]
    metadata: object  # the backend's build_metadata result
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]

    def attention(self, layer_idx: int, q, k, v, spec: LayerAttention | None = None
                  ) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer_idx]
        return self.backend.forward(q, k, v, k_cache, v_cache, self.metadata, spec)
