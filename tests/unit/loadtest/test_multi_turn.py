"""The `multi_turn` workload is what issue 36's benchmark asks for: 64 sessions of 8 turns,
each turn resending the conversation plus 150-400 new tokens, contexts growing to ~3k."""

from __future__ import annotations

from baton_loadtest.generator import plan
from baton_loadtest.spec import WorkloadSpec


def test_sessions_grow_by_150_to_400_tokens_a_turn_to_about_3k(tokenizer):
    spec = WorkloadSpec.load("loadtest/workloads/multi_turn.yaml")
    assert (spec.sessions.count, spec.sessions.turns) == (64, 8)
    assert spec.sessions.think_time_s > 0
    reqs, _ = plan(spec, tokenizer)
    assert len(reqs) == 64 * 8
    by_session: dict[int, list[int]] = {}
    for r in reqs:
        assert r.session is not None
        by_session.setdefault(r.session, []).append(len(tokenizer.encode(r.prompt)))
    assert len(by_session) == 64
    for lengths in by_session.values():
        assert len(lengths) == 8
        growth = [b - a for a, b in zip(lengths, lengths[1:])]
        assert all(140 <= g <= 410 for g in growth), growth  # joins add a few tokens
    last = sorted(lengths[-1] for lengths in by_session.values())
    assert 2400 <= last[len(last) // 2] <= 3400  # the median final context: ~3k
    assert last[-1] <= 4000
