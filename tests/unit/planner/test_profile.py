"""The cost-model fit recovers known coefficients, and a profile file is checked field by
field when loaded."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from baton.planner.profile import (
    DecodePoint,
    PrefillPoint,
    Profile,
    fit_decode,
    fit_prefill,
    nonnegative_lstsq,
)
from tests.unit.planner.factories import make_profile


def prefill_points(a, b, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    return [PrefillPoint(n, (a + b * n) * (1 + noise * rng.standard_normal()))
            for n in (128, 256, 512, 1024, 2048) for _ in range(3)]


def decode_points(c, d, e, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    return [DecodePoint(batch, ctx, batch * ctx,
                        (c + d * batch + e * batch * ctx) * (1 + noise * rng.standard_normal()))
            for batch in (1, 4, 16, 64) for ctx in (128, 1024, 4096)]


def test_prefill_fit_recovers_exact_coefficients():
    cost = fit_prefill(prefill_points(0.012, 3.5e-4))
    assert cost.a == pytest.approx(0.012, rel=1e-9)
    assert cost.b == pytest.approx(3.5e-4, rel=1e-9)
    assert cost.rmse_s < 1e-12 and cost.max_rel_error < 1e-9
    assert cost.seconds(1000) == pytest.approx(0.012 + 0.35)


def test_decode_fit_recovers_coefficients_under_noise():
    cost = fit_decode(decode_points(0.008, 4e-4, 3e-7, noise=0.01))
    assert cost.c == pytest.approx(0.008, rel=0.1)
    assert cost.d == pytest.approx(4e-4, rel=0.1)
    assert cost.e == pytest.approx(3e-7, rel=0.05)
    assert 0 < cost.rmse_s < 0.01 * 0.2  # ~1% of the largest step
    assert len(cost.points) == 12


def test_fit_never_returns_a_negative_coefficient():
    # Noise-free points of a line through the origin with a slightly negative intercept:
    # unconstrained least squares gives a < 0; the constrained fit pins a at 0.
    points = [PrefillPoint(n, -0.002 + 1e-4 * n) for n in (100, 200, 400)]
    x = np.array([[1.0, p.tokens] for p in points])
    y = np.array([p.seconds for p in points])
    assert np.linalg.lstsq(x, y, rcond=None)[0][0] < 0
    coef, rmse, _ = nonnegative_lstsq(x, y)
    assert coef[0] == 0.0 and coef[1] > 0 and rmse > 0
    assert fit_prefill(points).a == 0.0


def test_fits_need_enough_distinct_points():
    with pytest.raises(ValueError, match="2 distinct token counts"):
        fit_prefill([PrefillPoint(128, 0.1), PrefillPoint(128, 0.11)])
    with pytest.raises(ValueError, match="vary both batch and context"):
        fit_decode([DecodePoint(b, 128, b * 128, 0.01 * b) for b in (1, 2, 4)])


def test_chunked_prefill_pays_the_step_cost_per_chunk():
    cost = make_profile(a=0.01, b=1e-4).prefill
    times = cost.chunked_seconds(np.array([100, 2048, 2049, 5000]), 2048)
    assert times.tolist() == pytest.approx([0.01 + 0.01, 0.01 + 0.2048, 0.02 + 0.2049,
                                            0.03 + 0.5])


def test_profile_round_trips_through_yaml(tmp_path):
    profile = make_profile()
    fitted = fit_decode(decode_points(0.008, 4e-4, 3e-7))
    profile = Profile(profile.model, profile.dtype, profile.hardware, profile.limits,
                      fit_prefill(prefill_points(0.01, 2e-4)), fitted)
    path = tmp_path / "profile.yaml"
    profile.save(path)
    assert Profile.load(path) == profile
    raw = yaml.safe_load(path.read_text())
    assert raw["decode"]["points"][0] == {"batch": 1, "ctx": 128, "ctx_tokens_total": 128,
                                          "seconds": pytest.approx(0.008 + 4e-4 + 3e-7 * 128)}


def _raw():
    return make_profile().to_dict()


@pytest.mark.parametrize("edit, message", [
    (lambda r: r["prefill"].pop("b"), r"prefill\.b is missing"),
    (lambda r: r["decode"].update(e=-1e-7), r"decode\.e=-1e-07 must be a finite number >= 0"),
    (lambda r: r["decode"].update(c="fast"), r"decode\.c='fast' has the wrong type"),
    (lambda r: r.pop("hardware"), r"hardware is missing"),
    (lambda r: r["engine"].update(max_num_seqs=0), r"engine\.max_num_seqs=0 must be >= 1"),
    (lambda r: r.update(version=2), r"version=2 is not supported"),
    (lambda r: r["prefill"].update(a=0.0, b=0.0), r"prefill coefficients are all zero"),
    (lambda r: r["decode"]["points"].append({"batch": 1, "ctx": 2}),
     r"decode\.points\[0\]\.ctx_tokens_total is missing"),
])
def test_invalid_profile_names_the_field(edit, message):
    raw = _raw()
    edit(raw)
    with pytest.raises(ValueError, match=message):
        Profile.from_dict(raw)


def test_load_names_the_file_and_the_field(tmp_path):
    path = tmp_path / "p.yaml"
    raw = _raw()
    del raw["decode"]["d"]
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=rf"profile {path}: decode\.d is missing"):
        Profile.load(path)
    with pytest.raises(ValueError, match="cannot read it"):
        Profile.load(tmp_path / "absent.yaml")
    path.write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="the file must be a mapping"):
        Profile.load(path)


def test_prefill_fit_recovers_the_attention_term():
    # a + b n + q n (n + 1) / 2: what a prompt's causal attention adds per token grows with n
    points = [PrefillPoint(n, 0.05 + 3e-3 * n + 2e-5 * n * (n + 1) / 2)
              for n in (64, 128, 256, 512)]
    cost = fit_prefill(points)
    assert (cost.a, cost.b, cost.q) == pytest.approx((0.05, 3e-3, 2e-5), rel=1e-6)
    assert cost.seconds(1024) == pytest.approx(0.05 + 3.072 + 2e-5 * 1024 * 1025 / 2)
    # the linear model cannot follow the curve: its worst point is far off
    linear = nonnegative_lstsq(np.array([[1.0, p.tokens] for p in points]),
                               np.array([p.seconds for p in points]))
    assert linear[2] > 0.2 and cost.max_rel_error < 1e-6


def test_chunking_does_not_change_the_attention_pairs():
    cost = make_profile(a=0.01, b=1e-4).prefill
    quad = type(cost)(0.01, 1e-4, 1e-8)
    whole, cut = quad.chunked_seconds(np.array([3000]), 4096), quad.chunked_seconds(
        np.array([3000]), 1000)
    assert cut[0] - whole[0] == pytest.approx(2 * 0.01)  # two more steps, same attention
    assert whole[0] == pytest.approx(0.01 + 0.3 + 1e-8 * 3000 * 3001 / 2)


def test_a_profile_without_the_attention_term_loads_as_linear():
    raw = _raw()
    raw["prefill"].pop("q")
    assert Profile.from_dict(raw).prefill.q == 0.0


def concave_points(knots, e, contexts=(64, 256)):
    """Decode steps whose cost is piecewise linear in the batch (as on a CPU, where a few
    sequences share the weights' read) plus e per context token."""
    return [DecodePoint(b, ctx, b * ctx, t + e * b * ctx) for b, t in knots for ctx in contexts]


def test_decode_fit_follows_a_step_cost_that_is_not_linear_in_the_batch():
    knots = ((1, 0.045), (2, 0.062), (4, 0.089), (8, 0.105), (16, 0.120))
    cost = fit_decode(concave_points(knots, 2e-7))
    assert [b for b, _ in cost.knots] == [b for b, _ in knots]
    assert [t for _, t in cost.knots] == pytest.approx([t for _, t in knots], rel=1e-6)
    assert cost.e == pytest.approx(2e-7, rel=1e-6) and cost.max_rel_error < 1e-6
    # between knots along the segment, past the last one along the last segment
    assert cost.batch_seconds(3) == pytest.approx((0.062 + 0.089) / 2)
    assert cost.batch_seconds(24) == pytest.approx(0.120 + 8 * (0.120 - 0.105) / 8)
    assert cost.seconds(6, 6 * 100) == pytest.approx(0.097 + 2e-7 * 600)
    # the straight-line summary through the same points is far off at batch 1
    assert cost.c + cost.d > 0.045 * 1.15
    line = nonnegative_lstsq(np.array([[1.0, p.batch, p.ctx_tokens_total] for p in cost.points]),
                             np.array([p.seconds for p in cost.points]))
    assert line[2] > 0.15


def test_noisy_intercepts_are_made_non_decreasing_in_the_batch():
    # batch 4 measured faster than batch 2 (noise): a step never gets cheaper with more work
    cost = fit_decode(concave_points(((1, 0.04), (2, 0.07), (4, 0.065), (8, 0.1)), 1e-7))
    assert [t for _, t in cost.knots] == pytest.approx([0.04, 0.07, 0.07, 0.1], rel=1e-6)
    assert cost.batch_seconds(3) == pytest.approx(0.07)


def test_a_decode_cost_without_knots_is_the_straight_line():
    cost = make_profile(c=0.01, d=5e-4, e=2e-7).decode
    assert cost.knots == ()
    assert cost.seconds(8, 1000) == pytest.approx(0.01 + 8 * 5e-4 + 2e-7 * 1000)


def test_knots_round_trip_and_a_profile_recorded_before_them_loads_as_linear(tmp_path):
    base = make_profile()
    cost = fit_decode(concave_points(((1, 0.045), (4, 0.089), (16, 0.12)), 1e-7))
    profile = Profile(base.model, base.dtype, base.hardware, base.limits, base.prefill, cost)
    profile.save(tmp_path / "p.yaml")
    loaded = Profile.load(tmp_path / "p.yaml")
    assert loaded == profile and loaded.decode.batch_seconds(2) == cost.batch_seconds(2)
    raw = profile.to_dict()
    assert raw["decode"]["knots"][0] == {"batch": 1, "seconds": pytest.approx(0.045)}
    raw["decode"].pop("knots")
    old = Profile.from_dict(raw).decode
    assert old.knots == () and old.batch_seconds(2) == pytest.approx(cost.c + 2 * cost.d)


@pytest.mark.parametrize("knots, message", [
    ([{"batch": 4, "seconds": 0.1}, {"batch": 1, "seconds": 0.2}], "distinct and increasing"),
    ([{"batch": 1, "seconds": 0.2}, {"batch": 4, "seconds": 0.1}], "non-decreasing"),
    ([{"batch": 1}], r"decode\.knots\[0\]\.seconds is missing"),
    ([{"batch": 0, "seconds": 0.1}], "each >= 1"),
])
def test_bad_knots_are_refused_with_the_field_named(knots, message):
    raw = _raw()
    raw["decode"]["knots"] = knots
    with pytest.raises(ValueError, match=message):
        Profile.from_dict(raw)
