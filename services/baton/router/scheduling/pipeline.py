"""The routing pipeline: filters -> weighted scorers -> picker.

    pipeline = RoutingPipeline.from_policy("load")
    endpoint = pipeline.pick(discovery.all(), RoutingContext(model="m"))  # None: nobody fits

Policies are named presets; `filters`, `scorers` (name -> weight) and `picker` can also be
given directly, every name checked against the registries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.router.discovery import Upstream
from baton.router.scheduling.context import RoutingContext
from baton.router.scheduling.filters import FILTERS
from baton.router.scheduling.pickers import PICKERS
from baton.router.scheduling.scorers import SCORERS

DEFAULT_FILTERS = ("healthy", "circuit", "model", "role", "not_tried")
PREFILL_FILTERS = ("healthy", "circuit", "model", "role", "not_saturated")
POLICIES = {
    # lora 0.75: a worker holding the request's adapter keeps its traffic while it has
    # fewer than 3 requests queued against an idle worker that would load it (queue scorer)
    "load": ({"queue": 1.0, "kv_usage": 1.0, "prefix": 1.0, "session": 1.0, "lora": 0.75},
             "max_score"),
    "round_robin": ({}, "round_robin"),
    "random": ({}, "random"),
}


@dataclass
class RoutingPipeline:
    filters: tuple[str, ...] = DEFAULT_FILTERS
    scorers: dict[str, float] = field(default_factory=lambda: dict(POLICIES["load"][0]))
    picker: str = "max_score"

    def __post_init__(self) -> None:
        for name in self.filters:
            if name not in FILTERS:
                raise ValueError(f"unknown routing filter {name!r}; known: {sorted(FILTERS)}")
        for name, weight in self.scorers.items():
            if name not in SCORERS:
                raise ValueError(f"unknown routing scorer {name!r}; known: {sorted(SCORERS)}")
            if weight < 0:
                raise ValueError(f"routing scorer {name!r} has negative weight {weight}")
        if self.picker not in PICKERS:
            raise ValueError(f"unknown routing picker {self.picker!r}; known: {sorted(PICKERS)}")
        self._pick = PICKERS[self.picker]()

    @classmethod
    def from_policy(cls, policy: str, weights: dict[str, float] | None = None
                    ) -> RoutingPipeline:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; known: {sorted(POLICIES)}")
        scorers, picker = POLICIES[policy]
        return cls(scorers=dict(weights if weights is not None else scorers), picker=picker)

    def candidates(self, endpoints: list[Upstream], ctx: RoutingContext) -> list[Upstream]:
        for name in self.filters:
            endpoints = FILTERS[name](endpoints, ctx)
            if not endpoints:
                break
        return endpoints

    def scores(self, endpoints: list[Upstream], ctx: RoutingContext) -> list[float]:
        total = [0.0] * len(endpoints)
        for name, weight in self.scorers.items():
            if weight:
                for i, s in enumerate(SCORERS[name](endpoints, ctx)):
                    total[i] += weight * s
        return total

    def pick(self, endpoints: list[Upstream], ctx: RoutingContext) -> Upstream | None:
        cands = self.candidates(endpoints, ctx)
        if not cands:
            return None
        return self._pick(cands, self.scores(cands, ctx))
