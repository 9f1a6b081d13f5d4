"""Filters: which endpoints may take this request at all."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from baton.common.roles import Role
from baton.router.discovery import Upstream
from baton.router.scheduling.context import Phase, RoutingContext

Filter = Callable[[list[Upstream], RoutingContext], list[Upstream]]
FILTERS: dict[str, Filter] = {}


_F = TypeVar("_F", bound=Filter)


def register(name: str) -> Callable[[_F], _F]:
    def deco(fn: _F) -> _F:
        FILTERS[name] = fn
        return fn
    return deco


@register("healthy")
def healthy(endpoints: list[Upstream], ctx: RoutingContext) -> list[Upstream]:
    return [e for e in endpoints if e.healthy]


@register("circuit")
def circuit(endpoints: list[Upstream], ctx: RoutingContext) -> list[Upstream]:
    """Drop endpoints whose circuit breaker is open."""
    now = time.monotonic()
    return [e for e in endpoints if not e.circuit_open(now)]


@register("model")
def model(endpoints: list[Upstream], ctx: RoutingContext) -> list[Upstream]:
    return [e for e in endpoints if ctx.model is None or e.serves(ctx.model)]


@register("role")
def role(endpoints: list[Upstream], ctx: RoutingContext) -> list[Upstream]:
    """Upstreams that can run this request's phase: decoding (or a whole request) runs on
    `decode` or colocated `both` workers; a remote prefill only on `prefill` workers; a
    stream resumed after its decode pod died only on `decode` workers."""
    if ctx.phase == Phase.PREFILL:
        return [e for e in endpoints if e.role == Role.PREFILL]
    if ctx.phase == Phase.RESUME:
        return [e for e in endpoints if e.role == Role.DECODE]
    return [e for e in endpoints if e.role in (Role.BOTH, Role.DECODE)]


@register("not_saturated")
def not_saturated(endpoints: list[Upstream], ctx: RoutingContext) -> list[Upstream]:
    """Workers whose waiting queue has room (per their last report)."""
    return [e for e in endpoints if e.max_waiting is None or e.waiting < e.max_waiting]


@register("not_tried")
def not_tried(endpoints: list[Upstream], ctx: RoutingContext) -> list[Upstream]:
    """On a retry, endpoints that already failed this request are out."""
    return [e for e in endpoints if e.url not in ctx.tried]
