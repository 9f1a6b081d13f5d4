"""kv_tier_bench on a tiny cut of the workload: turns extend the previous turn's ids, and
with the tier the engine prefills fewer tokens for the same greedy output."""

from __future__ import annotations

import pytest

from benchmarks.kv_tier_bench import conversations, run

pytestmark = pytest.mark.slow


def test_turns_extend_each_other_and_the_tier_saves_prefill(tokenizer):
    convs = conversations(tokenizer, sessions=2, turns=3)
    for session in convs:
        for before, after in zip(session, session[1:]):
            assert after[:len(before)] == before and 150 <= len(after) - len(before) <= 420
    longest = max(len(s[-1]) for s in convs) + 2
    engine = dict(dtype="float32", num_kv_blocks=longest // 16 + 1, block_size=16,
                  max_model_len=(longest // 16 + 1) * 16, num_threads=1)
    plain = run(convs, 2, **engine)
    tier = run(convs, 2, **engine, kv_offload_gib=0.2)
    assert tier.tokens == plain.tokens
    assert len(tier.ttft_s) == len(plain.ttft_s) == 2 * 2
    assert tier.prefill_tokens < plain.prefill_tokens
    assert tier.cached_tokens - plain.cached_tokens == plain.prefill_tokens - tier.prefill_tokens
