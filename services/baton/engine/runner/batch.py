"""Build the flat batch of one step: token ids, positions, slot mapping and block tables."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from baton.engine.attention.base import BatchLayout
from baton.engine.request import Request
from baton.engine.scheduler.output import ScheduledRequest


@dataclass(frozen=True)
class PromptLogprobSpan:
    """Rows [row, row + count) of the batch hold prompt positions whose logits give the
    logprobs of prompt tokens first_target .. first_target + count - 1 (a request asking
    for `prompt_logprobs`). `gap`: prompt tokens before first_target that have none (a
    prefix-cache hit skipped their positions)."""

    request: Request
    row: int
    first_target: int
    count: int
    gap: int = 0


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    layout: BatchLayout
    entries: list[ScheduledRequest]  # in batch order (decodes first)
    logits_indices: list[int]  # last row of each entry that samples
    sampling_entries: list[ScheduledRequest]
    prompt_logprob_spans: list[PromptLogprobSpan] = field(default_factory=list)


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
    logits_indices, sampling, spans = [], [], []
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
        if s.writes_kv and s.request.prompt_logprobs is not None:
            span = _prompt_logprob_span(s.request, start, end, qsl[-2])
            if span is not None:
                spans.append(span)
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
        sampling_entries=sampling, prompt_logprob_spans=spans)


def _prompt_logprob_span(req: Request, start: int, end: int, first_row: int
                         ) -> PromptLogprobSpan | None:
    """Positions [start, end) run at rows first_row..: the logits at position p give the
    logprob of prompt token p + 1. Only prompt tokens not yet done (after a preemption the
    prompt runs again) and never the last position (its logits sample the first output)."""
    done = len(req.prompt_logprobs)  # prompt tokens 0 .. done - 1 have theirs
    first = max(start, done - 1)
    last = min(end, req.num_prompt_tokens - 1)
    if last <= first:
        return None
    return PromptLogprobSpan(req, first_row + first - start, first + 1, last - first,
                             gap=first + 1 - done)
