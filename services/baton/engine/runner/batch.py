"""Build the flat batch of one step: token ids, positions, slot mapping and block tables."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from baton.engine.attention.base import BatchLayout
from baton.engine.scheduler.output import ScheduledRequest

@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    layout: BatchLayout
    entries: list[ScheduledRequest]  # in batch order (decodes first)
    logits_indices: list[int]  # last row of each entry that samples
    sampling_entries: list[ScheduledRequest]


def build_batch(scheduled: list[ScheduledRequest], block_ids_of: Callable[[str], list[int]],
                block_size: int, device: torch.device) -> FlatBatch:
    # Decodes first, longest context first, so that attention backends can cut the decode
    # rows into groups of similar length and pad less.
    entries = sorted(scheduled, key=lambda s: (s.num_new_tokens != 1,
                                               -s.request.num_computed_tokens))
    num_decodes = sum(1 for s in entries if s.num_new_tokens == 1)
    tokens: list[int] = []
    positions: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    qsl, ctx_lens, seq_lens, tables = [0], [], [], []
    logits_indices, sampling = [], []
    for s in entries:
        start = s.start
        end = start + s.num_new_tokens
        blocks = np.asarray(block_ids_of(s.request.request_id), dtype=np.int64)
        pos = np.arange(start, end, dtype=np.int64)
        tokens.extend(s.input_ids(start, end))
        positions.append(pos)
        slots.append(blocks[pos // block_size] * block_size + pos % block_size if s.writes_kv
                     else np.full(s.num_new_tokens, -1, np.int64))  # -1: no KV write
        qsl.append(qsl[-1] + s.num_new_tokens)
        ctx_lens.append(start)
        seq_lens.append(end)
        tables.append(blocks)
        if s.samples:
            logits_indices.append(qsl[-1] - 1)
            sampling.append(s)
    max_blocks = max(len(t) for t in tables)
    table = np.zeros((len(tables), max_blocks), dtype=np.int64)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    layout = BatchLayout(
        query_start_loc=qsl, context_lens=ctx_lens, seq_lens=seq_lens, num_decodes=num_decodes,
        block_tables=torch.from_numpy(table).to(device),
        slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device),
        block_size=block_size)
    return FlatBatch(
        input_ids=torch.tensor(tokens, dtype=torch.long, device=device),
        positions=torch.from_numpy(np.concatenate(positions)).to(device),
        layout=layout, entries=entries, logits_indices=logits_indices,
        sampling_entries=sampling)
