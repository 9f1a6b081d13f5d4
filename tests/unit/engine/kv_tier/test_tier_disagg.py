"""The host tier on a decode engine, wrapping its P/D connector: pulls work as without it,
and a pulled prompt the device pool later evicts is served from the tier."""

from __future__ import annotations

import pytest

from baton import SamplingParams
from baton.common.hashing import hash_token_blocks
from baton.engine.config import EngineConfig
from baton.engine.core import EngineCore
from baton.engine.kv_tier import TierConnector
from tests.conftest import make_text
from tests.unit.engine.test_disagg import assert_no_blocks, colocated, decode, engine, prefill, run

pytestmark = pytest.mark.slow


def test_a_pulled_prompt_is_kept_in_the_decode_engines_tier(tokenizer):
    p, d = engine("prefill"), engine("decode", kv_offload_gib=0.2)
    c = EngineCore(EngineConfig.from_args(dtype="float32", num_kv_blocks=128))
    try:
        assert isinstance(d.connector, TierConnector)
        ids = tokenizer.encode(make_text(3) + "\nSummary:")
        tokens, _ = decode(d, "d", ids, prefill(p, "p", ids))
        assert tokens == colocated(c, "c", ids)
        assert d.connector.stats.transfers == 1 and d.connector.stats.bytes > 0
        assert_no_blocks(p, d)
        for k in range(6):  # 6 x 560 tokens turn the decode engine's 128 blocks over
            d.add_request(f"o{k}", tokenizer.encode(f"Note {k}.\n" + make_text(12, k))[:560],
                          SamplingParams(temperature=0, max_tokens=1))
            run(d)
        assert d.kv.pool.get_cached_block(hash_token_blocks(ids, 16)[0]) is None  # evicted
        follow_up = ids + tokens + tokenizer.encode("\nAnd in one line?")
        req = d.make_request("f", follow_up, SamplingParams(temperature=0, max_tokens=4))
        outs = d.add(req) + run(d)
        cached = [o.num_cached_tokens for o in outs if o.request_id == "f"][-1]
        assert cached == (len(ids) + len(tokens) - 1) // 16 * 16  # all from the tier
        assert d.connector.tier_stats().hit_tokens_total == cached
        assert_no_blocks(d)
    finally:
        p.close()
        d.close()
