"""The frames rank 0 sends its tensor-parallel followers: a step survives the trip exactly,
and a frame this version cannot read is refused before anything is allocated."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from baton.engine.config import EngineConfig
from baton.engine.runner.tp_wire import (
    _HEADER,
    MAX_FRAME_INT64S,
    FollowerSpec,
    StepMessage,
    TPProtocolError,
    logits_calls,
    read_message,
    stop_frame,
)


def step(num_calls: int = 2, pending: tuple[int, ...] = (0, 1)) -> StepMessage:
    rng = np.random.default_rng(0)
    T, B, M = 7, 3, 4
    return StepMessage(
        input_ids=rng.integers(0, 1000, T), positions=np.arange(T),
        slot_mapping=np.array([5, 6, -1, 8, 9, 10, 11]), query_start_loc=np.array([0, 1, 2, 7]),
        context_lens=np.array([4, 9, 0]), seq_lens=np.array([5, 10, 5]),
        block_tables=rng.integers(0, 50, (B, M)), num_decodes=2, block_size=16,
        logits_calls=[np.arange(2, 2 + i + 1) for i in range(num_calls)],
        pending_rows=np.asarray(pending, np.int64))


def test_step_round_trip_and_stop():
    msg = step()
    stream = io.BytesIO(msg.encode() + step(0, pending=()).encode() + stop_frame())
    got = read_message(stream)
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "context_lens",
                 "seq_lens", "block_tables", "pending_rows"):
        np.testing.assert_array_equal(getattr(got, name), getattr(msg, name), err_msg=name)
    assert (got.num_decodes, got.block_size) == (2, 16)
    assert [c.tolist() for c in got.logits_calls] == [[2], [2, 3]]
    batch, calls = got.to_device(torch.device("cpu"))
    assert [c.tolist() for c in calls] == [[2], [2, 3]]  # staged with the batch
    assert batch.layout.num_decodes == 2 and batch.layout.seq_lens == [5, 10, 5]
    assert batch.input_ids.tolist() == msg.input_ids.tolist()
    assert batch.layout.block_tables.tolist() == msg.block_tables.tolist()
    assert batch.pending_rows.tolist() == [0, 1]
    plain = read_message(stream)
    assert plain.logits_calls == [] and plain.to_device(torch.device("cpu"))[0].pending_rows is None
    assert read_message(stream) is None  # the stop frame
    assert read_message(stream) is None  # end of file: rank 0 gone


@pytest.mark.parametrize("damage", ["magic", "version", "oversize", "short", "truncated",
                                    "pending-row", "overflow"])
def test_bad_frames_are_refused(damage):
    frame = bytearray(step(pending=(0, 7) if damage == "pending-row" else (0,)).encode())
    head = list(_HEADER.unpack(bytes(frame[:_HEADER.size])))
    if damage == "magic":
        head[0] = b"XXXX"
    elif damage == "version":
        head[1] = 99
    elif damage == "oversize":
        head[-1] = MAX_FRAME_INT64S + 1
    elif damage == "short":  # counts need more than the payload holds
        head[3] += 100
    elif damage == "overflow":  # B * M past int64: refused, not wrapped
        head[4] = head[5] = 2**40
    frame[:_HEADER.size] = _HEADER.pack(*head)
    if damage == "truncated":
        frame = frame[:-8]
    with pytest.raises(TPProtocolError):
        read_message(io.BytesIO(bytes(frame)))


def test_spec_round_trip_and_version():
    config = EngineConfig.from_args(tensor_parallel_size=2, num_threads=1, kv_secret="s" * 32)
    spec = FollowerSpec.make(1, 2, 1234, "/models/x", 512, config)
    again = FollowerSpec.from_line(spec.to_line())
    assert again == spec and again.engine_config() == config
    bad = spec.to_line().replace(b'"version": 1', b'"version": 7')
    with pytest.raises(TPProtocolError, match="version 7"):
        FollowerSpec.from_line(bad)


def test_logits_calls_follow_the_runner():
    from baton.engine.runner.batch import FlatBatch, PromptLogprobSpan

    spans = [PromptLogprobSpan(None, row=3, first_target=1, count=5)]
    batch = FlatBatch(torch.zeros(9), torch.zeros(9), None, [], logits_indices=[0, 8],
                      sampling_entries=[object(), object()], prompt_logprob_spans=spans)
    assert [c.tolist() for c in logits_calls(batch, 2)] == [[3, 4], [5, 6], [7], [0, 8]]
    batch.sampling_entries = []
    assert len(logits_calls(batch, 256)) == 1


def test_config_checks_the_tensor_parallel_size():
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        EngineConfig.from_args(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="KV transfer between tensor-parallel pods"):
        EngineConfig.from_args(tensor_parallel_size=2, kv_transport="nixl")
    assert EngineConfig.from_args(tensor_parallel_size=2, kv_transport="tcp").kv_transfer.transport == "tcp"
    assert EngineConfig.from_args(
        tensor_parallel_size=2).parallel.tensor_parallel_size == 2


def control_frame(raw: bytes) -> bytes:
    from baton.engine.runner.tp_wire import KIND_CONTROL, MAGIC, VERSION

    padded = raw + b" " * (-len(raw) % 8)
    return _HEADER.pack(MAGIC, VERSION, KIND_CONTROL, len(raw), 0, 0, 0, 0, 0, 0,
                        len(padded) // 8) + padded


def _endpoint():
    from baton.common.internal import KVEndpointInfo, KVLayoutInfo

    return KVEndpointInfo("tcp", "e1", "127.0.0.1:1", KVLayoutInfo(2, 4, 1, 8, "float32", 2, 1, 2))


def test_kv_control_messages_round_trip_typed():
    from baton.engine.runner.tp_kv_messages import KVHold, KVPull, KVRelease, KVStart
    from baton.engine.runner.tp_wire import Control

    sent = [KVStart(engine_id="e1"), KVHold(lease="l1", blocks=[3, 4], ttl=30.0),
            KVRelease(lease="l1"), KVPull(tag="t", lease="l1", peers=[_endpoint()], src=[1],
                                          dst=[2], timeout=5.0)]
    stream = io.BytesIO(b"".join(Control(m).encode() for m in sent) + stop_frame())
    got = [read_message(stream) for _ in sent]
    assert [g.body for g in got] == sent
    assert read_message(stream) is None


@pytest.mark.parametrize("raw", [b'{"op": "drop_tables"}', b'{"op": "hold", "lease": "l"}',
                                 b'{"op": "release", "lease": "l", "extra": 1}', b"not json"])
def test_a_kv_control_message_this_version_cannot_read_is_refused(raw):
    with pytest.raises(TPProtocolError, match="cannot read"):
        read_message(io.BytesIO(control_frame(raw)))


def test_kv_replies_parse_typed():
    from baton.engine.runner.tp_kv_messages import REPLY, KVPulled, KVReleased, KVStarted

    assert REPLY.validate_json(KVStarted(endpoint=_endpoint()).model_dump_json()) == KVStarted(
        endpoint=_endpoint())
    pulled = REPLY.validate_json(b'{"op": "pulled", "tag": "t", "ok": false, "kind": '
                                 b'"LeaseExpiredError", "error": "gone"}')
    assert isinstance(pulled, KVPulled) and not pulled.ok and pulled.bytes == 0
    assert isinstance(REPLY.validate_json(b'{"op": "released", "lease": "l", "reason": "x"}'),
                      KVReleased)
