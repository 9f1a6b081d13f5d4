"""Filters: which endpoints may take this request at all."""

from __future__ import annotations

import time
from collections.abc import Callable

from baton.router.discovery import Endpoint
from baton.router.scheduling.context import RoutingContext

Filter = Callable[[list[Endpoint], RoutingContext], list[Endpoint]]
FILTERS: dict[str, Filter] = {}


def register(name: str):
    def deco(fn: Filter) -> Filter:
        FILTERS[name] = fn
        return fn
    return deco


@register("healthy")
def healthy(endpoints: list[Endpoint], ctx: RoutingContext) -> list[Endpoint]:
    return [e for e in endpoints if e.healthy]


@register("circuit")
def circuit(endpoints: list[Endpoint], ctx: RoutingContext) -> list[Endpoint]:
    """Drop endpoints whose circuit breaker is open."""
    now = time.monotonic()
    return [e for e in endpoints if not e.circuit_open(now)]


@register("model")
def model(endpoints: list[Endpoint], ctx: RoutingContext) -> list[Endpoint]:
    return [e for e in endpoints if ctx.model is None or e.model == ctx.model]


@register("role")
def role(endpoints: list[Endpoint], ctx: RoutingContext) -> list[Endpoint]:
    """Endpoints that can run this request's phase: decoding (or a whole request) runs on
    `decode` or colocated `both` workers; a remote prefill only on `prefill` workers; a
    stream resumed after its decode pod died only on `decode` workers."""
    if ctx.role == "prefill":
        return [e for e in endpoints if e.role == "prefill"]
    if ctx.role == "resume":
        return [e for e in endpoints if e.role == "decode"]
    return [e for e in endpoints if e.role in ("both", "decode")]


@register("not_saturated")
def not_saturated(endpoints: list[Endpoint], ctx: RoutingContext) -> list[Endpoint]:
    """Workers whose waiting queue has room (per their last report)."""
    return [e for e in endpoints if e.max_waiting is None or e.waiting < e.max_waiting]


@register("not_tried")
def not_tried(endpoints: list[Endpoint], ctx: RoutingContext) -> list[Endpoint]:
    """On a retry, endpoints that already failed this request are out."""
    return [e for e in endpoints if e.url not in ctx.tried]
