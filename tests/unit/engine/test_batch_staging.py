"""The batch builder moves a step's metadata to the device in one copy (`HostStaging`):
counted on the `meta` device; on CPU there is no copy at all, yet one step's tensors are
never overwritten by the next."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.common.sampling_params import SamplingParams
from baton.engine.request import Request
from baton.engine.runner.batch import build_batch
from baton.engine.scheduler.output import ScheduledRequest
from tests.unit.engine.test_sampler_device import Recorder

BLOCK = 4


def make_rows() -> tuple[list[ScheduledRequest], dict[str, list[int]]]:
    """Two decodes and a prefill chunk asking for prompt logprobs."""
    rows, blocks = [], {}
    for i, (prompt, computed, new) in enumerate([(9, 9, 1), (5, 6, 1), (10, 4, 6)]):
        params = SamplingParams(prompt_logprobs=2 if i == 2 else None)
        req = Request(f"r{i}", list(range(10 + 20 * i, 10 + 20 * i + prompt)), params,
                      max_tokens=8)
        req.output_token_ids = [7] * max(0, computed + new - prompt)
        req.num_computed_tokens = computed
        rows.append(ScheduledRequest(req, new))
        blocks[req.request_id] = [3 * i + b for b in range(3)]
    return rows, blocks


def test_one_host_to_device_copy_per_step():
    meta = torch.device("meta")
    rows, blocks = make_rows()
    with Recorder(meta) as rec:
        batch = build_batch(rows, blocks.__getitem__, BLOCK, meta)
    assert rec.copies == 1
    for t in (batch.input_ids, batch.positions, batch.layout.slot_mapping,
              batch.layout.block_tables, batch.logits_rows, batch.prompt_targets):
        assert t.device == meta
    assert batch.input_ids.shape == batch.positions.shape == (8,)
    assert batch.layout.block_tables.shape == (3, 3)


def test_on_cpu_the_tensors_are_views_of_one_packed_buffer():
    rows, blocks = make_rows()
    batch = build_batch(rows, blocks.__getitem__, BLOCK, torch.device("cpu"))
    storages = {t.untyped_storage().data_ptr() for t in (
        batch.input_ids, batch.positions, batch.layout.slot_mapping,
        batch.layout.block_tables, batch.logits_rows, batch.prompt_targets)}
    assert len(storages) == 1  # no copy: views of the host buffer
    # decodes first, longest context first: r0 (pos 9), r1 (pos 6), then r2's chunk 4..9
    assert batch.input_ids.tolist() == [7, 7, 54, 55, 56, 57, 58, 59]
    assert batch.positions.tolist() == [9, 6, 4, 5, 6, 7, 8, 9]
    # slot = block_table[p // 4] * 4 + p % 4
    assert batch.layout.slot_mapping.tolist() == [9, 18, 28, 29, 30, 31, 32, 33]
    assert batch.layout.block_tables.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert batch.logits_rows.tolist() == batch.logits_indices == [0, 1, 7]
    span = batch.prompt_logprob_spans[0]  # positions 4..8 predict prompt tokens 5..9
    assert (span.row, span.first_target, span.count) == (2, 5, 5)
    assert batch.prompt_targets.tolist() == list(range(55, 60))


def test_a_followers_step_comes_from_the_host_arrays_never_the_device():
    """What rank 0 sends a tensor-parallel follower (`tp_wire.StepMessage`) is made from the
    arrays the builder packed: built on the meta device (whose tensors hold no values to
    read), the step is the CPU batch's, pending rows included, and the follower's batch
    from it has the same inputs."""
    from baton.engine.runner.tp_wire import StepMessage

    rows, blocks = make_rows()
    rows[0].request.output_token_ids = []
    rows[0].request.add_pending()  # r0's input is the token the step before sampled
    built = {name: build_batch(rows, blocks.__getitem__, BLOCK, torch.device(name),
                               pending={"r0": 3}) for name in ("meta", "cpu")}
    msg = StepMessage.from_batch(built["meta"], [np.asarray(built["meta"].logits_indices)])
    cpu = built["cpu"]
    assert msg.input_ids.tolist()[1:] == cpu.input_ids.tolist()[1:] == [7, 54, 55, 56, 57,
                                                                          58, 59]
    assert msg.positions.tolist() == cpu.positions.tolist()
    assert msg.slot_mapping.tolist() == cpu.layout.slot_mapping.tolist()
    assert msg.block_tables.tolist() == cpu.layout.block_tables.tolist()
    assert msg.pending_rows.tolist() == cpu.pending_rows.tolist() == [0]
    assert cpu.pending_src.tolist() == [3]
    follower, _ = msg.to_device(torch.device("cpu"))
    assert follower.input_ids.tolist() == cpu.input_ids.tolist()
    assert follower.pending_rows.tolist() == [0]
    assert follower.layout.block_tables.tolist() == cpu.layout.block_tables.tolist()


def test_a_later_step_does_not_overwrite_an_earlier_ones_tensors():
    from baton.engine.staging import HostStaging

    rows, blocks = make_rows()
    staging = HostStaging(torch.device("cpu"))
    first = build_batch(rows, blocks.__getitem__, BLOCK, torch.device("cpu"), staging)
    ids = first.input_ids.clone()
    build_batch(rows[:1], {"r0": [9, 9, 9]}.__getitem__, BLOCK, torch.device("cpu"), staging)
    assert torch.equal(first.input_ids, ids)


def test_pack_keeps_ints_and_floats_exact():
    from baton.engine.staging import HostStaging

    ints, floats = HostStaging(torch.device("cpu")).pack(
        [[1, 2, -1, 2**40]], [[0.1, -2.5]])
    assert ints.dtype == torch.int64 and ints.tolist() == [1, 2, -1, 2**40]
    assert floats.dtype == torch.float64 and floats.tolist() == [0.1, -2.5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_one_pinned_buffer_is_reused_and_grows():
    from baton.engine.staging import HostStaging

    cuda = torch.device("cuda", torch.cuda.current_device())
    staging = HostStaging(cuda)
    a, = staging.pack([list(range(10))])
    buffer = staging._pinned
    assert buffer.is_pinned()
    b, = staging.pack([list(range(5, 15))])
    assert staging._pinned is buffer  # reused
    c, = staging.pack([list(range(10_000))])
    assert staging._pinned.numel() >= 10_000
    assert a.tolist() == list(range(10)) and b.tolist() == list(range(5, 15))
    assert c.tolist() == list(range(10_000))


def test_a_one_token_row_that_writes_no_kv_needs_no_block_there():
    """Slots of one-token rows are computed for all of them at once from the block table; a
    row that writes no KV (a static batch's padding) gets -1 even where its request holds no
    block at its position."""
    from baton.engine.scheduler.static import PaddingRow

    rows, blocks = make_rows()
    done = Request("done", list(range(40)), SamplingParams(), max_tokens=8)
    done.num_computed_tokens = 30  # re-fed at position 29, far past its one block
    blocks["done"] = [11]
    batch = build_batch([*rows, PaddingRow(done, 1)], blocks.__getitem__, BLOCK,
                        torch.device("cpu"))
    # decodes first, longest context first: the padding row (29), r0 (9), r1 (6), r2's chunk
    assert batch.positions.tolist() == [29, 9, 6, 4, 5, 6, 7, 8, 9]
    assert batch.layout.slot_mapping.tolist() == [-1, 9, 18, 28, 29, 30, 31, 32, 33]
    assert batch.logits_indices == [1, 2, 8]  # the padding row samples nothing
