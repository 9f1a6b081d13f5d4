"""What rank 0 tells its tensor-parallel followers, over each follower's stdin pipe.

Two messages, both typed and framed (never pickle): `FollowerSpec`, one JSON line at start
(which rank, where the store is, the engine config and model), then binary frames: one
`StepMessage` per model step (the flat batch the forward needs and the rows whose logits
rank 0 computes, since `compute_logits` is a collective) or the stop frame. A frame is a
fixed header (magic, version, kind, counts) and int64 arrays; its size is checked against
`MAX_FRAME_INT64S` before anything is allocated.

A step launched ahead (async scheduling, `runner/ahead.py`) has input rows whose token the
step before it sampled, on rank 0's device only: the message names those rows
(`pending_rows`) and rank 0 broadcasts their tokens in the process group right before the
forward (`ahead.fill_pending`), device to device, so no rank reads them on the host.

Why a pipe and not a broadcast in the process group: a follower waits between steps for as
long as the engine idles (hours), which a collective's timeout would not allow, and the
pipe's end-of-file tells it at once that rank 0 is gone.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import torch
from pydantic import ValidationError

from baton.engine.attention.base import BatchLayout
from baton.engine.config import EngineConfig
from baton.engine.runner.batch import FlatBatch, HostArrays
from baton.engine.runner.tp_kv_messages import CONTROL, KVControl
from baton.engine.staging import HostStaging

SPEC_VERSION = 1
MAGIC = b"BTPS"
VERSION = 2
KIND_STEP, KIND_STOP, KIND_CONTROL = 1, 2, 3
# magic, version, kind, tokens T, sequences B, table width M, num_decodes, block_size,
# logits calls C, pending rows P, payload length (int64s)
_HEADER = struct.Struct("<4sHHqqqqqqqq")
MAX_FRAME_INT64S = 1 << 27  # 1 GiB: far above any step's batch


class TPProtocolError(RuntimeError):
    """A frame from rank 0 that is not what this version speaks."""


@dataclass(frozen=True)
class FollowerSpec:
    """Everything a follower needs to join: its rank of `size`, the TCPStore's port on
    loopback, the model and the engine config (as JSON fields)."""

    rank: int
    size: int
    store_port: int
    model_dir: str
    max_model_len: int
    config: dict
    version: int = SPEC_VERSION

    def engine_config(self) -> EngineConfig:
        return EngineConfig.from_args(**self.config)

    def to_line(self) -> bytes:
        return (json.dumps(dataclasses.asdict(self)) + "\n").encode()

    @classmethod
    def from_line(cls, line: bytes) -> FollowerSpec:
        fields = json.loads(line)
        if fields.get("version") != SPEC_VERSION:
            raise TPProtocolError(f"follower spec version {fields.get('version')!r}; this "
                                  f"build speaks {SPEC_VERSION}")
        return cls(**fields)

    @classmethod
    def make(cls, rank: int, size: int, store_port: int, model_dir, max_model_len: int,
             config: EngineConfig) -> FollowerSpec:
        return cls(rank, size, store_port, str(model_dir), max_model_len, config.args())


@dataclass
class StepMessage:
    """One step as the followers run it: the flat batch's host arrays and, in call order,
    the batch rows of each `compute_logits` call rank 0 makes."""

    input_ids: np.ndarray  # (T,)
    positions: np.ndarray  # (T,)
    slot_mapping: np.ndarray  # (T,)
    query_start_loc: np.ndarray  # (B + 1,)
    context_lens: np.ndarray  # (B,)
    seq_lens: np.ndarray  # (B,)
    block_tables: np.ndarray  # (B, M)
    num_decodes: int
    block_size: int
    logits_calls: list[np.ndarray]  # each (rows,)
    # (P,): rows whose token rank 0 broadcasts before the forward (a step launched ahead)
    pending_rows: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros(0, np.int64))

    @classmethod
    def from_batch(cls, batch: FlatBatch, logits_calls: list[np.ndarray]) -> StepMessage:
        """The step of a batch `build_batch` made, from its host arrays (`FlatBatch.host`):
        never a read of the device's copy."""
        layout, host = batch.layout, batch.host
        if host is None:
            raise ValueError("a tensor-parallel step needs the batch's host arrays "
                             "(FlatBatch.host, set by build_batch)")
        return cls(host.input_ids, host.positions, host.slot_mapping,
                   np.asarray(layout.query_start_loc, np.int64),
                   np.asarray(layout.context_lens, np.int64),
                   np.asarray(layout.seq_lens, np.int64), host.block_table,
                   layout.num_decodes, layout.block_size, logits_calls, host.pending_rows)

    def encode(self) -> bytes:
        T, B = len(self.input_ids), len(self.seq_lens)
        M = self.block_tables.shape[1] if B else 0
        sizes = np.asarray([len(c) for c in self.logits_calls], np.int64)
        parts = [self.input_ids, self.positions, self.slot_mapping, self.query_start_loc,
                 self.context_lens, self.seq_lens, self.block_tables.reshape(-1), sizes,
                 self.pending_rows, *self.logits_calls]
        payload = np.concatenate([np.asarray(p, np.int64).reshape(-1) for p in parts])
        header = _HEADER.pack(MAGIC, VERSION, KIND_STEP, T, B, M, self.num_decodes,
                              self.block_size, len(sizes), len(self.pending_rows),
                              payload.size)
        return header + payload.tobytes()

    def to_device(self, device: torch.device, staging: HostStaging | None = None
                  ) -> tuple[FlatBatch, list[torch.Tensor]]:
        """The FlatBatch the forward runs on (no requests: followers never sample) and each
        logits call's rows, on the device in one copy through `staging` (the follower's,
        reused: pinned on CUDA, so the copy queues behind the step in flight instead of
        waiting for it, as a copy from pageable memory would)."""
        staging = staging if staging is not None else HostStaging(device)
        ids, positions, slots, table, pending, *calls = staging.pack([*HostArrays(
            self.input_ids, self.positions, self.slot_mapping, self.block_tables,
            self.pending_rows).parts(), *self.logits_calls])
        layout = BatchLayout(
            query_start_loc=self.query_start_loc.tolist(),
            context_lens=self.context_lens.tolist(), seq_lens=self.seq_lens.tolist(),
            num_decodes=self.num_decodes, block_tables=table.view(self.block_tables.shape),
            slot_mapping=slots, block_size=self.block_size)
        return FlatBatch(ids, positions, layout, [], [], [],
                         pending_rows=pending if len(self.pending_rows) else None), calls


@dataclass(frozen=True)
class Control:
    """A KV-transfer control message (`tp_kv_messages.KVControl`, from
    `engine/kv_connector/tp_ranks.py`), framed like a step (header, then the JSON bytes
    padded to whole int64s; the header's T field is its length in bytes)."""

    body: KVControl

    def encode(self) -> bytes:
        raw = self.body.model_dump_json().encode()
        padded = raw + b" " * (-len(raw) % 8)
        return _HEADER.pack(MAGIC, VERSION, KIND_CONTROL, len(raw), 0, 0, 0, 0, 0, 0,
                            len(padded) // 8) + padded

    @classmethod
    def decode(cls, raw: bytes) -> Control:
        try:
            return cls(CONTROL.validate_json(raw))
        except ValidationError as err:
            raise TPProtocolError(f"a control frame this version cannot read: "
                                  f"{err.errors()[0]['msg']} ({raw[:80]!r})") from None


def stop_frame() -> bytes:
    return _HEADER.pack(MAGIC, VERSION, KIND_STOP, 0, 0, 0, 0, 0, 0, 0, 0)


def read_message(stream: BinaryIO) -> StepMessage | Control | None:
    """The next step (or control message), or None at the stop frame or end of file (rank 0 gone). Raises
    TPProtocolError on a frame this version cannot read."""
    head = _read_exactly(stream, _HEADER.size)
    if head is None:
        return None
    magic, version, kind, T, B, M, num_decodes, block_size, C, P, n = _HEADER.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise TPProtocolError(f"frame magic {magic!r} version {version}; expected {MAGIC!r} "
                              f"version {VERSION}")
    if kind == KIND_STOP:
        return None
    if kind == KIND_CONTROL and 0 <= n <= MAX_FRAME_INT64S and 0 <= T <= 8 * n:
        body = _read_exactly(stream, 8 * n)
        return None if body is None else Control.decode(body[:T])
    if (kind != KIND_STEP or not 0 <= n <= MAX_FRAME_INT64S or min(T, B, M, C, P) < 0
            or max(T, B, C, P, B * M) > n):  # each count within the payload: no overflow
        raise TPProtocolError(f"bad frame: kind {kind}, {n} int64s")
    body = _read_exactly(stream, 8 * n)
    if body is None:
        return None
    data = np.frombuffer(body, dtype=np.int64)
    cuts = np.cumsum([T, T, T, B + 1, B, B, B * M, C, P])
    if cuts[-1] > n:
        raise TPProtocolError(f"frame of {n} int64s is shorter than its counts say")
    ids, pos, slots, qsl, ctx, seq, tables, sizes, pending, rest = np.split(data, cuts)
    if sizes.sum() != len(rest) or (sizes < 0).any():
        raise TPProtocolError("frame's logits calls do not add up")
    if P and ((pending < 0) | (pending >= T)).any():
        raise TPProtocolError("frame's pending rows are outside its tokens")
    calls = np.split(rest, np.cumsum(sizes)[:-1]) if C else []
    return StepMessage(ids.copy(), pos.copy(), slots.copy(), qsl, ctx, seq,
                       tables.reshape(B, M).copy(), num_decodes, block_size,
                       [c.copy() for c in calls], pending.copy())


def logits_calls(batch: FlatBatch, rows_per_call: int) -> list[np.ndarray]:
    """The batch rows of each `compute_logits` call `ModelRunner.execute` makes, in order:
    the prompt-logprob spans in chunks of `rows_per_call`, then the sampling rows."""
    calls = []
    for span in batch.prompt_logprob_spans:
        for first in range(0, span.count, rows_per_call):
            n = min(rows_per_call, span.count - first)
            calls.append(np.arange(span.row + first, span.row + first + n, dtype=np.int64))
    if batch.sampling_entries:
        calls.append(np.asarray(batch.logits_indices, np.int64))
    return calls


def _read_exactly(stream: BinaryIO, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            if buf:
                raise TPProtocolError(f"pipe closed mid-frame ({len(buf)}/{n} bytes)")
            return None
        buf += chunk
    return bytes(buf)
