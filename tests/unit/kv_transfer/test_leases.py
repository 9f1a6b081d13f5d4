"""The holder's `LeaseTable`: random ids, a lease bound to its first puller, bounded takes,
and the TTL semantics the engine relies on."""

from __future__ import annotations

import time

import pytest

from baton.kv_transfer.base import LeaseExpiredError
from baton.kv_transfer.leases import LeaseTable


def test_ids_are_random_url_safe_and_unrelated_to_the_request():
    table = LeaseTable(num_blocks=8)
    ids = [table.hold(f"req-{i}", [i], 30) for i in range(6)]
    assert len(set(ids)) == 6
    assert all(len(lid) == 32 and "req" not in lid for lid in ids)  # 192 bits, base64url
    with pytest.raises(LeaseExpiredError):
        table.take("req-0", [0], "p")


def test_a_request_holds_one_lease_and_blocks_stay_in_the_cache():
    table = LeaseTable(num_blocks=8)
    table.hold("r", [1, 2], 30)
    with pytest.raises(ValueError, match="already held"):
        table.hold("r", [3], 30)
    for bad in ([8], [-1]):
        with pytest.raises(ValueError, match="outside"):
            table.hold("s", bad, 30)
    with pytest.raises(ValueError):
        table.hold("s", [1], 0)


def test_the_first_puller_owns_the_lease():
    table = LeaseTable(num_blocks=8)
    lid = table.hold("r", [1, 2, 3], 30)
    assert table.take(lid, [1, 2], "a@10.0.0.1") == [1, 2]
    table.abandon(lid)  # a's read failed
    with pytest.raises(LeaseExpiredError, match="another puller"):
        table.take(lid, [1, 2], "b@10.0.0.2")
    with pytest.raises(LeaseExpiredError, match="another puller"):
        table.take(lid, [], "a@10.0.0.2")  # same id, another host: another peer
    assert table.take(lid, [1, 2, 3], "a@10.0.0.1") == [1, 2, 3]
    with pytest.raises(LeaseExpiredError):  # being read
        table.take(lid, [1], "a@10.0.0.1")
    table.complete(lid)
    assert table.released() == [("r", "pulled")]
    with pytest.raises(LeaseExpiredError):
        table.take(lid, [1], "a@10.0.0.1")
    table.hold("r", [4], 30)  # the request may hold again once its lease ended


@pytest.mark.parametrize("blocks", [[1, 1], [1, 2, 3, 4], [9]],
                         ids=["repeated", "more-than-held", "not-held"])
def test_a_take_stays_inside_the_lease(blocks):
    table = LeaseTable(num_blocks=16)
    lid = table.hold("r", [1, 2, 3], 30)
    with pytest.raises(LeaseExpiredError):
        table.take(lid, blocks, "p")
    assert table.take(lid, [3, 1], "p") == [3, 1]  # a failed take claims nothing


def test_ttl_expiry_but_never_under_a_reader():
    table = LeaseTable()
    reading = table.hold("a", [1], 0.1)
    table.hold("b", [2], 0.1)
    table.take(reading, [1], "p")
    time.sleep(0.15)
    assert table.released() == [("b", "expired")]
    table.abandon(reading)
    assert table.released() == [("a", "expired")]
    assert len(table) == 0


def test_release_all_reports_each_request_once():
    table = LeaseTable()
    table.hold("a", [1], 30)
    table.hold("b", [2], 30)
    table.release_all()
    assert sorted(table.released()) == [("a", "closed"), ("b", "closed")]
    assert table.released() == []


def test_the_holder_may_end_a_lease_nobody_will_pull():
    table = LeaseTable()
    idle, busy = table.hold("idle", [1], 30), table.hold("busy", [2], 30)
    table.take(busy, [2], "p")
    assert table.release(idle) and not table.release(idle)
    assert not table.release(busy) and not table.release("guessed")
    assert table.released() == [("idle", "released")]
