"""Scorers: each maps every candidate to [0, 1], higher is better; the pipeline sums them
with configured weights."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TypeVar

from baton.router.discovery import Upstream
from baton.router.prefix import peer_fetch_value
from baton.router.scheduling.context import RoutingContext

Scorer = Callable[[list[Upstream], RoutingContext], list[float]]
SCORERS: dict[str, Scorer] = {}


_F = TypeVar("_F", bound=Scorer)


def register(name: str) -> Callable[[_F], _F]:
    def deco(fn: _F) -> _F:
        SCORERS[name] = fn
        return fn
    return deco


@register("queue")
def queue(endpoints: list[Upstream], ctx: RoutingContext) -> list[float]:
    """Fewer running + waiting requests is better: 1 for an idle worker, 1/(1+q) for q."""
    return [1.0 / (1.0 + e.queue_depth) for e in endpoints]


@register("prefix")
def prefix(endpoints: list[Upstream], ctx: RoutingContext) -> list[float]:
    """A longer share of the prompt probably cached on the worker is better, each block
    weighed by the tier that holds it: device over host over disk (`router.prefix`). With
    peer fetch, the blocks another candidate holds count for a candidate that would pull
    them as the prefill the pull saves, fixed cost included (`prefix.peer_fetch_value`):
    less than any tier of its own, more than nothing once the pull is worth it."""
    hashes, index = ctx.prefix_hashes, ctx.prefix_index
    if not hashes or index is None:
        return [0.0] * len(endpoints)
    own = [index.weighted_match(e, hashes) for e in endpoints]
    if ctx.peer_fetch_min_tokens is not None:  # what another holds, this one would pull
        matches = [index.match(e, hashes) for e in endpoints]
        best = max(matches)
        own = [w + peer_fetch_value(best - m, ctx.block_tokens, ctx.peer_fetch_min_tokens)
               for w, m in zip(own, matches)]
    return [w / len(hashes) for w in own]


@register("kv_usage")
def kv_usage(endpoints: list[Upstream], ctx: RoutingContext) -> list[float]:
    """More free KV cache is better."""
    return [1.0 - min(max(e.kv_usage, 0.0), 1.0) for e in endpoints]


@register("session")
def session(endpoints: list[Upstream], ctx: RoutingContext) -> list[float]:
    """1 for the session's own worker, 0 for the others: rendezvous hashing of the session
    key with each candidate's URL, so a session keeps its worker while that worker stays
    (and only the sessions of a worker that leaves move)."""
    if not ctx.session or not endpoints:
        return [0.0] * len(endpoints)
    key = ctx.session.encode()

    def weight(e: Upstream) -> bytes:
        return hashlib.blake2b(key + b"\0" + e.url.encode(), digest_size=8).digest()

    best = max(endpoints, key=weight)
    return [1.0 if e is best else 0.0 for e in endpoints]


@register("lora")
def lora(endpoints: list[Upstream], ctx: RoutingContext) -> list[float]:
    """A request naming a LoRA adapter: 1 where the worker holds its host copy, 0 where it
    would read it from disk first — affinity to the pods that have it, which the load
    scorers outweigh once those are busy (spill-over). The same for every worker for a
    base model request."""
    if ctx.model is None:
        return [1.0] * len(endpoints)
    return [0.0 if ctx.model in e.lora_adapters and ctx.model not in e.lora_loaded else 1.0
            for e in endpoints]
