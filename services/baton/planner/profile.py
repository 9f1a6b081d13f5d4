"""A hardware profile: what one engine step costs on this machine, as two fitted cost models.

    prefill_s(tokens)                    = a + b * tokens + q * tokens (tokens + 1) / 2
    decode_step_s(batch, ctx_tokens_total) = g(batch) + e * ctx_tokens_total

`g` is piecewise linear through one fitted knot per measured batch size (and extended past
the largest along its last segment): a decode step is not linear in the batch. One sequence
reads every weight for a single row; a few more share that read almost for free, and only
later does the step become compute-bound (fp32 on one CPU core: 45 ms at batch 1, 89 ms at
4, 120 ms at 16, where the straight line `c + d * batch` through the same points is off by
up to 32% and under-predicted a served run's p90 ITL by 24%). `c + d * batch` is kept as
the straight-line summary `baton profile` prints, and is the model of profiles recorded
before the knots.

`q` prices attention inside the prompt: token i of a prompt attends to the i tokens before
it and itself, so a prompt of n tokens costs n (n + 1) / 2 such pairs however it is chunked
(on one CPU core a 512-token prompt costs ~1.5x per token what a 64-token one does).
`ctx_tokens_total` is the sum of the running sequences' contexts (batch x context length).
The coefficients are fitted by non-negative least squares on measured points
(`planner.measure`), saved as YAML with the raw points, the fit residuals, the hardware and
the engine limits they were measured under, and loaded back by `Profile.load`, which checks
every field and names the one that is missing or out of range.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

PROFILE_VERSION = 1


@dataclass(frozen=True)
class PrefillPoint:
    tokens: int
    seconds: float


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    ctx: int  # context length of each sequence when the timed steps began
    ctx_tokens_total: int  # sum of the contexts over the batch, averaged over timed steps
    seconds: float


@dataclass(frozen=True)
class PrefillCost:
    """`seconds(tokens) = a + b * tokens + q * pairs(tokens)` for one prefill step."""

    a: float  # seconds per step
    b: float  # seconds per prompt token
    q: float = 0.0  # seconds per (token, earlier token) pair attended inside the prompt
    rmse_s: float = 0.0  # root-mean-square residual of the fit
    max_rel_error: float = 0.0  # largest |fit - measured| / measured over the points
    points: tuple[PrefillPoint, ...] = ()

    def __post_init__(self) -> None:
        _check_coefficients("prefill", {"a": self.a, "b": self.b, "q": self.q})

    def seconds(self, tokens: int) -> float:
        return self.a + self.b * tokens + self.q * attention_pairs(tokens)

    def chunked_seconds(self, tokens: np.ndarray, chunk: int) -> np.ndarray:
        """Service time of whole prompts cut into steps of at most `chunk` tokens (the
        attention pairs are the same however the prompt is cut)."""
        steps = np.ceil(tokens / chunk)
        return self.a * steps + self.b * tokens + self.q * attention_pairs(tokens)


def attention_pairs(tokens):
    """(query, key) pairs of causal attention over a prompt of `tokens` tokens."""
    return tokens * (tokens + 1) / 2


@dataclass(frozen=True)
class DecodeCost:
    """`seconds(batch, ctx_tokens_total) = g(batch) + e * ctx_tokens_total`, g piecewise
    linear through `knots`; without knots g(batch) = c + d * batch."""

    c: float  # seconds per step (straight-line summary of the knots)
    d: float  # seconds per sequence in the batch (ditto)
    e: float  # seconds per context token attended to
    rmse_s: float = 0.0
    max_rel_error: float = 0.0
    points: tuple[DecodePoint, ...] = ()
    # (batch, seconds of a step of that many sequences over no context), batch increasing,
    # seconds non-decreasing
    knots: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        _check_coefficients("decode", {"c": self.c, "d": self.d, "e": self.e})
        batches = [b for b, _ in self.knots]
        seconds = [s for _, s in self.knots]
        if batches != sorted(set(batches)) or any(b < 1 for b in batches):
            raise ValueError(f"profile: decode.knots batches {batches} must be distinct "
                             "and increasing, each >= 1")
        if any(not math.isfinite(s) or s < 0 for s in seconds) or seconds != sorted(seconds):
            raise ValueError(f"profile: decode.knots seconds {seconds} must be finite, >= 0 "
                             "and non-decreasing in the batch")

    def seconds(self, batch: int, ctx_tokens_total: int) -> float:
        return self.batch_seconds(batch) + self.e * ctx_tokens_total

    def batch_seconds(self, batch: float) -> float:
        """g(batch): the step's cost over no context (`batch` in rows: with speculation a
        sequence's guesses are rows too, so it need not be whole)."""
        if not self.knots:
            return self.c + self.d * batch
        k = bisect.bisect_left(self.knots, (batch, -math.inf))
        if k < len(self.knots) and self.knots[k][0] == batch:
            return self.knots[k][1]
        if len(self.knots) == 1 or k == 0:
            return self.knots[0][1]
        (b0, s0), (b1, s1) = self.knots[min(k, len(self.knots) - 1) - 1:][:2]
        return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)


@dataclass(frozen=True)
class Hardware:
    device: str  # "cpu" or "cuda"
    cpu: str
    gpu: str | None
    torch: str
    threads: int


@dataclass(frozen=True)
class EngineLimits:
    """The engine settings the profile was measured under; the planner simulates pods that
    run with the same ones (prefill chunk = max_num_batched_tokens, max batch = max_num_seqs)."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size"):
            _positive(f"engine.{name}", getattr(self, name))
        if self.max_model_len < 2:
            raise ValueError(f"profile: engine.max_model_len={self.max_model_len} must be >= 2")


@dataclass(frozen=True)
class Profile:
    model: str
    dtype: str
    hardware: Hardware
    limits: EngineLimits
    prefill: PrefillCost
    decode: DecodeCost
    version: int = PROFILE_VERSION

    def to_dict(self) -> dict:
        return {
            "version": self.version, "model": self.model, "dtype": self.dtype,
            "hardware": vars(self.hardware).copy(), "engine": vars(self.limits).copy(),
            "prefill": _cost_dict(self.prefill, ("a", "b", "q")),
            "decode": _cost_dict(self.decode, ("c", "d", "e")) | {
                "knots": [{"batch": b, "seconds": float(t)} for b, t in self.decode.knots]},
        }

    @classmethod
    def from_dict(cls, raw: object, where: str = "profile") -> Profile:
        """Build from parsed YAML; a missing or invalid field raises ValueError naming it."""
        try:
            return cls._from_dict(_mapping(raw, ""))
        except ValueError as err:
            raise ValueError(f"{where}: {str(err).removeprefix('profile: ')}") from None

    @classmethod
    def _from_dict(cls, raw: dict) -> Profile:
        version = _field(raw, "", "version", int)
        if version != PROFILE_VERSION:
            raise ValueError(f"version={version} is not supported (expected {PROFILE_VERSION})")
        model, dtype = _field(raw, "", "model", str), _field(raw, "", "dtype", str)
        hw = _mapping(raw.get("hardware"), "hardware")
        eng = _mapping(raw.get("engine"), "engine")
        return cls(
            model=model, dtype=dtype,
            hardware=Hardware(*(_field(hw, "hardware", k, t) for k, t in _HARDWARE_FIELDS)),
            limits=EngineLimits(*(_field(eng, "engine", k, int) for k in _LIMIT_FIELDS)),
            prefill=_prefill_from(_mapping(raw.get("prefill"), "prefill")),
            decode=_decode_from(_mapping(raw.get("decode"), "decode")),
            version=version)

    def save(self, path: str | Path) -> None:
        import yaml

        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        import yaml

        try:
            raw = yaml.safe_load(Path(path).read_text())
        except OSError as err:
            raise ValueError(f"profile {path}: cannot read it ({err.strerror})") from None
        except yaml.YAMLError as err:
            raise ValueError(f"profile {path}: not valid YAML ({err})") from None
        return cls.from_dict(raw, where=f"profile {path}")


_HARDWARE_FIELDS = (("device", str), ("cpu", str), ("gpu", (str, type(None))),
                    ("torch", str), ("threads", int))
_LIMIT_FIELDS = ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size")


# -- fitting ------------------------------------------------------------------------------
def fit_prefill(points: list[PrefillPoint]) -> PrefillCost:
    """Fit `a + b * tokens + q * pairs` to measured prefill steps; with only two distinct
    token counts the attention term cannot be told apart and q is 0."""
    distinct = len({p.tokens for p in points})
    if distinct < 2:
        raise ValueError("prefill fit: needs points at >= 2 distinct token counts")
    x = np.array([[1.0, p.tokens, attention_pairs(p.tokens)] for p in points])
    x = x if distinct >= 3 else x[:, :2]
    y = np.array([p.seconds for p in points])
    coef, rmse, rel = nonnegative_lstsq(x, y)
    a, b, q = (*coef, 0.0)[:3]
    return PrefillCost(a, b, q, rmse, rel, tuple(points))


def fit_decode(points: list[DecodePoint]) -> DecodeCost:
    """Fit `g(batch) + e * ctx_tokens_total` to measured decode steps: one intercept per
    measured batch size and one context coefficient, by non-negative least squares; the
    intercepts, made non-decreasing in the batch, are g's knots, and `c + d * batch` is the
    straight line through them."""
    batches = sorted({p.batch for p in points})
    x = np.array([[float(p.batch == b) for b in batches] + [p.ctx_tokens_total]
                  for p in points])
    if len(batches) < 2 or np.linalg.matrix_rank(x) < x.shape[1]:
        raise ValueError("decode fit: needs >= 2 batch sizes and, for at least one, "
                         "points that vary both batch and context")
    y = np.array([p.seconds for p in points])
    coef, _, _ = nonnegative_lstsq(x, y)
    knots = tuple(zip(batches, np.maximum.accumulate(coef[:-1]).tolist()))
    e = float(coef[-1])
    (c, d), _, _ = nonnegative_lstsq(np.array([[1.0, b] for b in batches]),
                                     np.array([s for _, s in knots]))
    cost = DecodeCost(float(c), float(d), e, points=tuple(points), knots=knots)
    pred = np.array([cost.seconds(p.batch, p.ctx_tokens_total) for p in points])
    rmse = math.sqrt(float(np.mean((pred - y) ** 2)))
    rel = float(np.max(np.abs(pred - y) / np.maximum(y, 1e-12)))
    return replace(cost, rmse_s=rmse, max_rel_error=rel)


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float, float]:
    """Least squares with every coefficient >= 0 (a cost never shrinks with more work).

    Exact for the 2-3 columns here: solve on every subset of columns, keep the feasible
    solution with the smallest residual (measurement noise can make a tiny intercept come
    out negative; the constrained fit then sets it to zero). Returns (coefficients, RMSE,
    max relative error)."""
    best, best_sse = np.zeros(x.shape[1]), math.inf
    for k in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            sol, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
            if np.any(sol < 0):
                continue
            coef = np.zeros(x.shape[1])
            coef[list(cols)] = sol
            sse = float(np.sum((x @ coef - y) ** 2))
            if sse < best_sse - 1e-18:
                best, best_sse = coef, sse
    pred = x @ best
    rel = float(np.max(np.abs(pred - y) / np.maximum(y, 1e-12)))
    return best, math.sqrt(best_sse / len(y)), rel


# -- YAML helpers -------------------------------------------------------------------------
def _cost_dict(cost, names: tuple[str, ...]) -> dict:
    out: dict[str, object] = {n: float(getattr(cost, n)) for n in names}
    out |= {"rmse_s": float(cost.rmse_s), "max_rel_error": float(cost.max_rel_error),
            "points": [vars(p).copy() for p in cost.points]}
    return out


def _prefill_from(raw: dict) -> PrefillCost:
    points = tuple(PrefillPoint(_field(p, f"prefill.points[{i}]", "tokens", int),
                                _field(p, f"prefill.points[{i}]", "seconds", float))
                   for i, p in enumerate(_points(raw, "prefill")))
    a, b, rmse, rel = (_field(raw, "prefill", k, float)
                       for k in ("a", "b", "rmse_s", "max_rel_error"))
    # profiles recorded before the attention term have no q: theirs is the linear model
    q = _field(raw, "prefill", "q", float) if "q" in raw else 0.0
    return PrefillCost(a, b, q, rmse, rel, points)


def _decode_from(raw: dict) -> DecodeCost:
    points = []
    for i, p in enumerate(_points(raw, "decode")):
        where = f"decode.points[{i}]"
        batch, ctx, ctx_total = (_field(p, where, k, int)
                                 for k in ("batch", "ctx", "ctx_tokens_total"))
        points.append(DecodePoint(batch, ctx, ctx_total, _field(p, where, "seconds", float)))
    c, d, e, rmse, rel = (_field(raw, "decode", k, float)
                          for k in ("c", "d", "e", "rmse_s", "max_rel_error"))
    # profiles recorded before the knots have none: theirs is the straight line
    knots = tuple((_field(k, f"decode.knots[{i}]", "batch", int),
                   _field(k, f"decode.knots[{i}]", "seconds", float))
                  for i, k in enumerate(_items(raw, "knots", "decode")))
    return DecodeCost(c, d, e, rmse, rel, tuple(points), knots)


def _points(raw: dict, where: str) -> list[dict]:
    return _items(raw, "points", where)


def _items(raw: dict, name: str, where: str) -> list[dict]:
    items = raw.get(name, [])
    if not isinstance(items, list):
        raise ValueError(f"profile: {where}.{name} must be a list")
    return [_mapping(p, f"{where}.{name}[{i}]") for i, p in enumerate(items)]


def _mapping(raw: object, where: str) -> dict:
    if raw is None:
        raise ValueError(f"profile: {where or 'the file'} is missing" + ("" if where else
                                                                          " or empty"))
    if not isinstance(raw, dict):
        raise ValueError(f"profile: {where or 'the file'} must be a mapping")
    return raw


def _field(raw: dict, where: str, name: str, kind):
    path = f"{where}.{name}" if where else name
    if name not in raw:
        raise ValueError(f"profile: {path} is missing")
    value = raw[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"profile: {path}={value!r} has the wrong type")
    if isinstance(value, (int, float)) and (not math.isfinite(value) or value < 0):
        raise ValueError(f"profile: {path}={value!r} must be a finite number >= 0")
    return value


def _check_coefficients(where: str, values: dict[str, float]) -> None:
    for name, value in values.items():
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"profile: {where}.{name}={value!r} must be a finite number >= 0")
    if sum(values.values()) <= 0:
        raise ValueError(f"profile: {where} coefficients are all zero (a step cannot be free)")


def _positive(path: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"profile: {path}={value} must be >= 1")
