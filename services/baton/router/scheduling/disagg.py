"""Disaggregation deciders: once the decode pod is picked, prefill the prompt on a prefill pod
(remote) or on the decode pod itself (local)? As in llm-d, P/D is decided after the decode
pod is chosen, so what that pod already caches counts.

A decider is a plain function registered by name, like the filters and scorers:
`decide(decode_pod, ctx, settings) -> True` for a remote prefill. It mutates nothing; the
caller (`router.remote_prefill`) counts the decision and finds the prefill pod. `settings`
is the live `DisaggSettings` of the request (the tuning file's
`router.disagg_min_prefill_tokens` changes it without a restart).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from baton.router.discovery import Upstream
from baton.router.scheduling.context import RoutingContext

Decider = Callable[[Upstream | None, RoutingContext, "DisaggSettings"], bool]
DECIDERS: dict[str, Decider] = {}


_F = TypeVar("_F", bound=Decider)


def register(name: str) -> Callable[[_F], _F]:
    def deco(fn: _F) -> _F:
        DECIDERS[name] = fn
        return fn
    return deco


@register("uncached_tokens")
def uncached_tokens(decode_pod: Upstream | None, ctx: RoutingContext,
                    settings: DisaggSettings) -> bool:
    """Remote when the prompt's tokens not already cached on the decode pod (in any tier, or
    on a peer it will pull them from: `ctx.peer_tokens`) are at least `min_prefill_tokens`;
    local when the prompt cannot be split (`n` > 1, several prompts)."""
    if ctx.prompt_tokens is None:
        return False
    cached = ctx.cached_tokens(decode_pod) if decode_pod is not None else 0
    return ctx.prompt_tokens - max(cached, ctx.peer_tokens) >= settings.min_prefill_tokens


@dataclass(frozen=True)
class DisaggSettings:
    """Remote prefill when `decider` says so (by default: the prompt tokens not already
    cached on the chosen decode pod are at least `min_prefill_tokens`) and a prefill worker
    is healthy and not saturated; `n` > 1 and several prompts stay local. With the registry
    the router counts the prompt's tokens and the pod's cached blocks exactly; without it,
    it estimates (~4 characters a token; the cache as `router.prefix` knows it). A remote
    prefill that takes longer than `prefill_timeout_s` falls back to a local one."""

    min_prefill_tokens: int = 256
    prefill_timeout_s: float = 60.0
    decider: str = "uncached_tokens"
    # A decode pod pulls a prompt's prefix another pod holds (`router.peer_fetch`) when that
    # saves at least this many tokens of prefill and the cost model says pulling is cheaper.
    peer_fetch: bool = True
    peer_fetch_min_tokens: int = 256

    def __post_init__(self) -> None:
        if self.min_prefill_tokens < 0 or self.prefill_timeout_s <= 0 \
                or self.peer_fetch_min_tokens < 0:
            raise ValueError("DisaggSettings: min_prefill_tokens >= 0, prefill_timeout_s > 0, "
                             "peer_fetch_min_tokens >= 0")
        if self.decider not in DECIDERS:
            raise ValueError(f"DisaggSettings.decider: unknown disaggregation decider "
                             f"{self.decider!r}; known: {sorted(DECIDERS)}")

    def decide(self, decode_pod: Upstream | None, ctx: RoutingContext) -> bool:
        """True: prefill remotely (this settings' decider, with these settings)."""
        return DECIDERS[self.decider](decode_pod, ctx, self)
