"""Workload generation matches its parameters (fixed seeds, statistical tests)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from baton_loadtest.generator import arrival_times, plan, sample_lengths
from baton_loadtest.spec import ArrivalSpec, LengthSpec, SpecError, WorkloadSpec


def rng(seed=0):
    return np.random.default_rng(seed)


def test_lognormal_lengths_match_median_and_sigma():
    spec = LengthSpec(dist="lognormal", median=150, sigma=0.9, min=1, max=10 ** 9)
    xs = sample_lengths(spec, 20000, rng())
    assert np.median(xs) == pytest.approx(150, rel=0.05)
    logs = np.log(xs[xs > 5])  # rounding distorts only the smallest values
    assert np.std(np.log(xs)) == pytest.approx(0.9, rel=0.05)
    assert stats.kstest(np.log(xs), "norm", args=(np.log(150), 0.9)).pvalue > 0.001 or \
        stats.kstest(logs, "norm", args=(np.log(150), 0.9)).statistic < 0.02


def test_lognormal_is_clipped_and_uniform_and_fixed():
    clipped = sample_lengths(LengthSpec(dist="lognormal", median=100, sigma=2, min=8,
                                        max=300), 5000, rng())
    assert clipped.min() == 8 and clipped.max() == 300
    u = sample_lengths(LengthSpec(dist="uniform", min=10, max=19), 20000, rng())
    counts = np.bincount(u - 10, minlength=10)
    assert u.min() == 10 and u.max() == 19
    assert stats.chisquare(counts).pvalue > 0.001
    assert set(sample_lengths(LengthSpec(dist="fixed", value=7), 100, rng())) == {7}


def test_poisson_arrivals_are_exponential_at_the_rate():
    t = np.asarray(arrival_times(ArrivalSpec(process="poisson", rate=4.0), rng(), n=20000))
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert 1 / gaps.mean() == pytest.approx(4.0, rel=0.03)
    assert stats.kstest(gaps, "expon", args=(0, 0.25)).pvalue > 0.001


def test_gamma_burstiness_sets_the_coefficient_of_variation():
    t = arrival_times(ArrivalSpec(process="gamma", rate=2.0, burstiness=0.25), rng(), n=40000)
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert 1 / gaps.mean() == pytest.approx(2.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.07)  # 1/sqrt(0.25)


def test_step_arrivals_follow_the_steps_and_duration():
    spec = ArrivalSpec(process="step", rates=(2.0, 20.0, 2.0), step_s=50.0)
    t = np.asarray(arrival_times(spec, rng()))
    assert t.max() < 150
    per_step = [((t >= a) & (t < a + 50)).sum() / 50 for a in (0, 50, 100)]
    assert per_step[0] == pytest.approx(2, rel=0.25)
    assert per_step[1] == pytest.approx(20, rel=0.1)
    assert per_step[2] == pytest.approx(2, rel=0.25)
    t = arrival_times(ArrivalSpec(process="poisson", rate=10.0), rng(), duration_s=30.0)
    assert max(t) < 30 and len(t) == pytest.approx(300, rel=0.15)


def test_prompts_are_real_text_of_the_requested_length(tokenizer):
    spec = WorkloadSpec(num_requests=30, prompt_tokens=LengthSpec(dist="uniform", min=20,
                                                                  max=400))
    reqs, _ = plan(spec, tokenizer)
    want = sample_lengths(spec.prompt_tokens, 1, np.random.default_rng([0, 1, 0]))[0]
    assert len(tokenizer.encode(reqs[0].prompt)) == pytest.approx(want, abs=3)
    total_tokens = 0
    for r in reqs:
        n = len(tokenizer.encode(r.prompt))
        assert 17 <= n <= 403
        total_tokens += n
    # Words, not token soup: English averages well over two letters per token.
    assert sum(c.isalpha() for r in reqs for c in r.prompt) > 2 * total_tokens
    assert len({r.prompt for r in reqs}) == 30  # never the same prompt twice
    again, _ = plan(spec, tokenizer)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]  # seeded


def test_sessions_share_prefixes_and_chain_turns(tokenizer):
    spec = WorkloadSpec.parse({
        "num_requests": 12, "system_prompt_tokens": 50,
        "sessions": {"count": 4, "turns": 3, "think_time_s": 0.5},
        "prompt_tokens": 20, "output_tokens": 10,
        "arrival": {"process": "poisson", "rate": 5}})
    reqs, _ = plan(spec, tokenizer)
    assert len(reqs) == 12
    system = reqs[0].messages[0]
    assert system["role"] == "system"
    assert all(r.messages[0] == system for r in reqs)  # one common system prompt
    for r in reqs:
        if r.after is None:
            assert r.arrival_s is not None and len(r.messages) == 2
        else:
            prev = reqs[r.after]
            assert r.session == prev.session and r.think_time_s == 0.5
            assert r.messages[:len(prev.messages)] == prev.messages
            assert r.messages[len(prev.messages)]["role"] == "assistant"


def test_grounded_prompts_hand_over_a_passage_to_work_on(tokenizer):
    spec = WorkloadSpec.load("loadtest/workloads/grounded.yaml").with_overrides(num_requests=12)
    reqs, _ = plan(spec, tokenizer)
    asks = ("Add a docstring", "Rename", "Return this code", "Copy this code", "Quote",
            "Fix the grammar", "Rewrite this passage")
    for r in reqs:
        ask, _, passage = r.messages[-1]["content"].partition("\n\n")
        assert ask.startswith(asks) and len(passage) >= 150
        assert 100 <= r.max_tokens <= 400
    assert sum("```python" in r.prompt for r in reqs) >= 3  # code and prose both
    assert sum("```python" not in r.prompt for r in reqs) >= 1
    again, _ = plan(spec, tokenizer)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]  # seeded


@pytest.mark.parametrize("raw, field", [
    ({"content": "poetry"}, "content"),
    ({"prompt_tokens": {"dist": "zipf"}}, "prompt_tokens.dist"),
    ({"arrival": {"process": "poisson", "rate": 0}}, "arrival.rate"),
    ({"arrival": {"process": "step", "rates": []}}, "arrival.rates"),
    ({"num_requests": 5, "duration_s": 3}, "num_requests"),
    ({"bogus": 1}, "unknown keys"),
    ({"output_tokens": {"dist": "uniform", "min": 5, "max": 2}}, "min <= max"),
])
def test_bad_workloads_name_the_field(raw, field):
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        WorkloadSpec.parse(raw)


def test_shipped_workloads_parse():
    from pathlib import Path

    files = sorted(Path("loadtest/workloads").glob("*.yaml"))
    assert any(f.name == "chat.yaml" for f in files)
    for f in files:
        WorkloadSpec.load(f)
