"""Penalties under async scheduling with the inputs on the device: a penalised request's
pending last token is read from the last step's token tensor, giving the logits and tokens
it would with the token known on the host (`engine/penalty_ids.py`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.engine.penalty_ids import PendingTokens, id_rows, pending_sources, with_pending
from baton.engine.request import PENDING
from baton.engine.sampler import Sampler
from tests.unit.engine.test_sampler import V, make_req


def test_a_pending_id_is_kept_as_a_placeholder_and_ids_out_of_range_are_dropped():
    out, lens = id_rows([[[5, V, -7, 9, PENDING]], [[PENDING]], [[]]], V)
    assert lens == [3, 1, 0]
    assert out.tolist() == [[5, 9, V], [V, V, V], [0, 0, 0]]  # padded with the row's last
    filled = with_pending(torch.from_numpy(out), torch.tensor([11, 12, 13]), V)
    assert filled.tolist() == [[5, 9, 11], [12, 12, 12], [0, 0, 0]]
    assert np.array_equal(id_rows([[[1, 2]]], V)[0], [[1, 2]])


def test_a_pending_token_needs_the_step_that_sampled_it():
    waiting, known = make_req("a", outputs=[4, PENDING]), make_req("b", outputs=[4])
    assert pending_sources([known], None) is None
    with pytest.raises(RuntimeError, match="pending"):
        pending_sources([waiting], None)
    with pytest.raises(RuntimeError, match="did not sample"):
        pending_sources([waiting], PendingTokens(torch.tensor([3]), {"b": 0}))
    assert pending_sources([known, waiting], PendingTokens(torch.tensor([3, 4]),
                                                           {"a": 1, "b": 0})) == [0, 1]


@pytest.mark.parametrize("params", [
    {"frequency_penalty": 0.7},
    {"presence_penalty": 1.5},
    {"repetition_penalty": 1.8},
    {"frequency_penalty": 0.4, "presence_penalty": 0.3, "repetition_penalty": 1.3},
])
def test_penalties_read_a_pending_token_on_the_device_as_if_it_were_known(params):
    lg = torch.zeros(3, V)
    top = [10, 11, 12]  # each row's favourite, just ahead of its second
    for row in range(3):
        lg[row, top[row]], lg[row, 20 + row] = 1.0, 0.95
    prev = torch.tensor([99, top[2], 98, top[0]])  # the last step's sampled tokens
    pending = PendingTokens(prev, {"a": 3, "c": 1, "x": 0})
    reqs_ids = (("a", [5, top[0]]), ("b", [5]), ("c", [top[2], top[2]]))
    known = [make_req(rid, temperature=0, outputs=out, **params) for rid, out in reqs_ids]
    waiting = [make_req(rid, temperature=0, outputs=out[:-1] + [PENDING], **params)
               if rid != "b" else make_req(rid, temperature=0, outputs=out, **params)
               for rid, out in reqs_ids]
    want = Sampler().sample_on_device(lg, known).tokens
    got = Sampler().sample_on_device(lg, waiting, pending=pending).tokens
    assert got.tolist() == want.tolist()
    assert got.tolist() == [20, 11, 22]  # a's and c's pending favourite was penalised
    with pytest.raises(RuntimeError, match="pending"):
        Sampler().sample_on_device(lg, waiting)
