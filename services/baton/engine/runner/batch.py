"""Build the flat batch of one step: token ids, positions, slot mapping, block tables and
the rows whose logits are sampled, all moved to the device in one copy (`HostStaging`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from baton.engine.attention.base import BatchLayout
from baton.engine.request import Request
from baton.engine.scheduler.output import ScheduledRequest
from baton.engine.staging import HostStaging

BlockRow = Sequence[int] | np.ndarray  # a request's block table row (the KV manager's kept row)


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


@dataclass(frozen=True)
class HostArrays:
    """A batch's integer arrays as built on the host, before their copy to the device: what
    a tensor-parallel follower is sent (`tp_wire.StepMessage`), so that nothing reads them
    back from the device (on CUDA that read would wait for the step in flight)."""

    input_ids: np.ndarray  # (T,)
    positions: np.ndarray  # (T,)
    slot_mapping: np.ndarray  # (T,)
    block_table: np.ndarray  # (B, M)
    pending_rows: np.ndarray  # (P,): `FlatBatch.pending_rows`, possibly empty

    def parts(self) -> list[np.ndarray]:
        """The 1-D arrays as `HostStaging.pack` takes them (the table flattened)."""
        return [self.input_ids, self.positions, self.slot_mapping, self.block_table.reshape(-1),
                self.pending_rows]


@dataclass
class FlatBatch:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    layout: BatchLayout
    entries: list[ScheduledRequest]  # in batch order (decodes first)
    # the rows that sample: each sampling entry's last, or with guesses its last 1 + k
    logits_indices: list[int]
    sampling_entries: list[ScheduledRequest]
    prompt_logprob_spans: list[PromptLogprobSpan] = field(default_factory=list)
    logits_rows: torch.Tensor | None = None  # (S,) int64 on the device: logits_indices
    # (sum of the spans' counts,) int64 on the device: the prompt tokens the spans' rows
    # predict, span after span
    prompt_targets: torch.Tensor | None = None
    # Async scheduling on the device (`runner/ahead.py`): the rows whose input is a token
    # the previous step sampled, not known on the host, and where each is in that step's
    # sampled tokens; (P,) int64 on the device, or None
    pending_rows: torch.Tensor | None = None
    pending_src: torch.Tensor | None = None
    host: HostArrays | None = None  # set by `build_batch`

    @property
    def seq_requests(self) -> list[Request]:
        """The request of each sequence of `layout`, in its order (`engine.lora` reads it)."""
        return [s.request for s, _, _ in _pieces(self.entries)]


def build_batch(scheduled: list[ScheduledRequest], block_ids_of: Callable[[str], BlockRow],
                block_size: int, device: torch.device, staging: HostStaging | None = None,
                pending: dict[str, int] | None = None) -> FlatBatch:
    """The step's flat batch; its tensors reach `device` in one copy through `staging` (the
    runner's, reused; a fresh one when None). A request verifying guesses (`engine.spec`)
    becomes one decode per row, each attending its own context, as plain decodes'.
    `pending`: request id -> its pending token's row in the last step's sampled tokens."""
    entries = sorted(scheduled, key=lambda s: (s.num_new_tokens != 1 and not s.spec_token_ids,
                                               -s.request.num_computed_tokens))
    pieces = _pieces(entries)
    num_decodes = sum(1 for _, _, n in pieces if n == 1)  # the one-token rows, first
    g = _Rows()
    for s, start, count in pieces:
        g.add(s, start, count, block_ids_of(s.request.request_id), block_size)
    sampling, logits_indices = _sampling_rows(entries, g.last_row, g.row_of)
    table = _block_table(g.tables)
    positions = np.asarray(g.ctx_lens[:num_decodes], dtype=np.int64)  # one-token rows'
    slots = _one_token_slots(table, positions, g.no_kv, block_size)
    qsl, targets = g.qsl, g.targets
    pending_rows, pending_src = _pending_inputs(pieces, qsl, pending)
    host = HostArrays(np.asarray(g.tokens, np.int64),
                      np.concatenate([positions, *g.chunk_positions]),
                      np.concatenate([slots, *g.chunk_slots]), table,
                      np.asarray(pending_rows, np.int64))
    ids, pos, slot_mapping, flat_table, p_rows, rows, prompt_targets, p_src = (
        staging or HostStaging(device)).pack(
        [*host.parts(), logits_indices, np.concatenate(targets) if targets else [], pending_src])
    layout = BatchLayout(
        query_start_loc=qsl, context_lens=g.ctx_lens, seq_lens=g.seq_lens,
        num_decodes=num_decodes,
        block_tables=flat_table.view(table.shape), slot_mapping=slot_mapping,
        block_size=block_size)
    return FlatBatch(
        input_ids=ids, positions=pos, layout=layout, entries=entries,
        logits_indices=logits_indices, sampling_entries=sampling, prompt_logprob_spans=g.spans,
        logits_rows=rows, prompt_targets=prompt_targets, host=host,
        pending_rows=p_rows if pending_rows else None, pending_src=p_src if pending_rows else None)


@dataclass
class _Rows:
    """What `build_batch` gathers piece by piece (`_pieces`' order): token ids, the chunks'
    positions and slots (one-token rows' are computed at once, from `ctx_lens` and the
    table), query start offsets, context and sequence lengths, block table rows, and where
    each entry's tokens land."""

    tokens: list[int] = field(default_factory=list)
    chunk_positions: list[np.ndarray] = field(default_factory=list)
    chunk_slots: list[np.ndarray] = field(default_factory=list)
    qsl: list[int] = field(default_factory=lambda: [0])
    ctx_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    tables: list[BlockRow] = field(default_factory=list)
    no_kv: list[int] = field(default_factory=list)  # one-token rows writing no KV (padding)
    last_row: dict[int, int] = field(default_factory=dict)  # entry of one piece -> last row
    row_of: dict[tuple[int, int], int] = field(default_factory=dict)  # verifying (entry, pos)
    spans: list[PromptLogprobSpan] = field(default_factory=list)
    targets: list[np.ndarray] = field(default_factory=list)

    def add(self, s: ScheduledRequest, start: int, count: int, blocks: BlockRow,
            block_size: int) -> None:
        """The piece of `s` feeding positions [start, start + count)."""
        end = start + count
        self.tokens.extend(s.input_ids(start, end))
        if count == 1:
            if not s.writes_kv:
                self.no_kv.append(len(self.ctx_lens))
        else:
            chunk = np.arange(start, end, dtype=np.int64)
            self.chunk_positions.append(chunk)
            self.chunk_slots.append(_slots(blocks, chunk, block_size) if s.writes_kv
                                    else np.full(count, -1, np.int64))
        row = self.qsl[-1] + count - 1
        if s.spec_token_ids:
            self.row_of[(id(s), end - 1)] = row
        else:
            self.last_row[id(s)] = row
        self.qsl.append(row + 1)
        self.ctx_lens.append(start)
        self.seq_lens.append(end)
        self.tables.append(blocks)
        if s.writes_kv and s.request.prompt_logprobs is not None:
            _add_span(self.spans, self.targets, s.request, start, end, self.qsl[-2])


def _one_token_slots(table: np.ndarray, positions: np.ndarray, no_kv: list[int],
                     block_size: int) -> np.ndarray:
    """The cache slot of each one-token row i (`table` row i, at positions[i]), all at once;
    -1 for the rows in `no_kv`, which write no KV (and need hold no block there)."""
    rows = np.arange(len(positions))
    if no_kv:
        rows = np.delete(rows, no_kv)
    at = positions[rows]
    slots = np.full(len(positions), -1, dtype=np.int64)
    slots[rows] = table[rows, at // block_size] * block_size + at % block_size
    return slots


def _sampling_rows(entries: list[ScheduledRequest], last_row: dict[int, int],
                   row_of: dict[tuple[int, int], int]) -> tuple[list[ScheduledRequest], list[int]]:
    """The entries that sample, in order, and the batch rows of their sampled logits: an
    entry's last position, or with guesses its last 1 + k (`last_row`: the row of the last
    token of each entry of one piece; `row_of`: a verifying entry's rows by position)."""
    sampling: list[ScheduledRequest] = []
    rows: list[int] = []
    for s in entries:
        k = s.num_sampled
        if not k:
            continue
        sampling.append(s)
        last = last_row.get(id(s))
        if last is None:  # one piece a row: by position
            end = s.start + s.num_new_tokens
            rows.extend(row_of[(id(s), p)] for p in range(end - k, end))
        elif k == 1:
            rows.append(last)
        else:
            rows.extend(range(last - k + 1, last + 1))
    return sampling, rows


def _pending_inputs(pieces: list[tuple[ScheduledRequest, int, int]], qsl: list[int],
                    pending: dict[str, int] | None) -> tuple[list[int], list[int]]:
    """The rows whose input is a pending token (its request's first unknown position) and
    where each is in the previous step's sampled tokens (`build_batch`'s `pending`)."""
    rows: list[int] = []
    src: list[int] = []
    if pending is None:
        return rows, src
    for (s, start, count), first_row in zip(pieces, qsl):
        req = s.request
        if not req.num_pending:
            continue
        known = req.num_known_tokens
        if start + count > known:
            rows.append(first_row + known - start)
            src.append(pending[req.request_id])
    return rows, src


def _pieces(entries: list[ScheduledRequest]) -> list[tuple[ScheduledRequest, int, int]]:
    """(entry, first position, rows) of each sequence of the batch: decodes first, longest
    context first (attention backends cut decode rows into groups of similar length and pad
    less), a verifying request split into one-row decodes; then the prompt chunks."""
    pieces = []
    for s in entries:
        if s.spec_token_ids:
            pieces += [(s, s.start + r, 1) for r in range(s.num_new_tokens)]
        else:
            pieces.append((s, s.start, s.num_new_tokens))
    return sorted(pieces, key=lambda p: (p[2] != 1, -p[1]))


def _add_span(spans: list[PromptLogprobSpan], targets: list[np.ndarray], req: Request,
              start: int, end: int, first_row: int) -> None:
    """The prompt-logprob span of a chunk of `req` (positions [start, end) at rows
    first_row..) and the prompt tokens it predicts, when it has one."""
    span = _prompt_logprob_span(req, start, end, first_row)
    if span is not None:
        spans.append(span)
        targets.append(np.asarray(req.prompt_token_ids[
            span.first_target:span.first_target + span.count], dtype=np.int64))


def _slots(blocks: BlockRow, pos: np.ndarray, block_size: int) -> np.ndarray:
    """The cache slots of positions `pos` of a sequence whose blocks are `blocks`."""
    return np.asarray(blocks, dtype=np.int64)[pos // block_size] * block_size + pos % block_size


def _block_table(tables: list[BlockRow]) -> np.ndarray:
    """(B, max blocks) int64, rows padded with block 0 (filled in one masked write, not a
    write per row: a large batch's rows cost more written one by one than built)."""
    lengths = np.fromiter(map(len, tables), np.int64, len(tables))
    table = np.zeros((len(tables), int(lengths.max())), dtype=np.int64)
    flat = np.concatenate(tables, dtype=np.int64, casting="unsafe")  # an empty list: float
    table[np.arange(table.shape[1]) < lengths[:, None]] = flat  # row by row, in order
    return table


def _prompt_logprob_span(req: Request, start: int, end: int, first_row: int
                         ) -> PromptLogprobSpan | None:
    """Positions [start, end) run at rows first_row..: the logits at position p give the
    logprob of prompt token p + 1. Only prompt tokens not yet done (after a preemption the
    prompt runs again) and never the last position (its logits sample the first output)."""
    assert req.prompt_logprobs is not None  # the caller checked
    done = len(req.prompt_logprobs)  # prompt tokens 0 .. done - 1 have theirs
    first = max(start, done - 1)
    last = min(end, req.num_prompt_tokens - 1)
    if last <= first:
        return None
    return PromptLogprobSpan(req, first_row + first - start, first + 1, last - first,
                             gap=first + 1 - done)
