"""Pickers: choose one endpoint from the scored candidates."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import TypeVar

from baton.router.discovery import Upstream

Picker = Callable[[list[Upstream], list[float]], Upstream]
PICKERS: dict[str, Callable[[], Picker]] = {}  # name -> factory (pickers may keep state)


_F = TypeVar("_F", bound=Callable[[], Picker])


def register(name: str) -> Callable[[_F], _F]:
    def deco(factory: _F) -> _F:
        PICKERS[name] = factory
        return factory
    return deco


@register("max_score")
def max_score() -> Picker:
    """The best score; ties go round-robin, so equal workers share the load."""
    turn = itertools.count()

    def pick(endpoints: list[Upstream], scores: list[float]) -> Upstream:
        best = max(scores)
        tied = [e for e, s in zip(endpoints, scores) if s >= best - 1e-9]
        return tied[next(turn) % len(tied)]
    return pick


@register("round_robin")
def round_robin() -> Picker:
    """Each endpoint in turn, ignoring scores (stable order by URL)."""
    turn = itertools.count()

    def pick(endpoints: list[Upstream], scores: list[float]) -> Upstream:
        ordered = sorted(endpoints, key=lambda e: e.url)
        return ordered[next(turn) % len(ordered)]
    return pick


@register("random")
def weighted_random(seed: int | None = None) -> Picker:
    """Random, with probability proportional to score (uniform when all scores are 0)."""
    rng = random.Random(seed)

    def pick(endpoints: list[Upstream], scores: list[float]) -> Upstream:
        if sum(scores) <= 0:
            return rng.choice(endpoints)
        return rng.choices(endpoints, weights=scores, k=1)[0]
    return pick
