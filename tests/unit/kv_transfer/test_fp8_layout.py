"""FP8 KV caches over every installed transport: a pull moves the cache's bytes (one per
element, half of bf16), and an FP8 cache and a bf16 one refuse each other at connect."""

from __future__ import annotations

import pytest
import torch

from baton.common.internal import KVLayoutInfo
from baton.kv_transfer.base import LayoutMismatchError, TransferState, bytes_per_block
from tests.unit.kv_transfer.factories import cache


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_blocks_move_as_bytes(make, dtype):
    src_kv, dst_kv = cache(dtype=dtype), cache(dtype=dtype, fill=False)
    holder, ep = make(src_kv)
    puller, _ = make(dst_kv)
    lease = holder.hold("r1", [3, 7], ttl_s=30)
    puller.connect(ep)
    t = puller.pull(ep, lease, [3, 7], [1, 12], timeout_s=10)
    assert t.wait(10) == TransferState.DONE, t.error
    assert torch.equal(dst_kv[:, :, [1, 12]].view(torch.uint8),
                       src_kv[:, :, [3, 7]].view(torch.uint8))
    assert t.bytes == 2 * bytes_per_block(ep.layout)
    assert 2 * bytes_per_block(ep.layout) == bytes_per_block(KVLayoutInfo.of(cache(dtype=torch.bfloat16)))


def test_bf16_and_fp8_caches_refuse_each_other(make):
    fp8_holder, fp8_ep = make(cache(dtype=torch.float8_e4m3fn))
    bf16_holder, bf16_ep = make(cache(dtype=torch.bfloat16))
    e5m2, _ = make(cache(dtype=torch.float8_e5m2, fill=False))
    assert len({fp8_ep.layout.fingerprint, bf16_ep.layout.fingerprint}) == 2
    with pytest.raises(LayoutMismatchError, match="float8_e4m3fn.*bfloat16|bfloat16.*float8"):
        bf16_holder.connect(fp8_ep)  # a bf16 decode pod, an FP8 prefill pod
    with pytest.raises(LayoutMismatchError, match="bfloat16"):
        fp8_holder.connect(bf16_ep)
    with pytest.raises(LayoutMismatchError, match="float8_e5m2"):
        e5m2.connect(fp8_ep)  # the two FP8 formats differ too
