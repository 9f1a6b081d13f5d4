"""What the routing plugins know about the request being routed."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace

from baton.router.discovery import Upstream
from baton.router.prefix import PrefixIndex


class Phase(enum.StrEnum):
    """The part of a request being routed, which decides the workers that may take it
    (the `role` filter)."""

    DECODE = "decode"  # a whole request, or its decode: `decode` or colocated `both` workers
    PREFILL = "prefill"  # a remote prefill: `prefill` workers
    RESUME = "resume"  # a stream whose decode pod died: another `decode` worker


@dataclass(frozen=True)
class RoutingContext:
    """Built once per request (`router.routing_context`) and never changed in place: the
    remote prefill routes with a copy in the prefill phase, and the retry loop
    (`router.retry`) derives each next attempt's context with `after_failure`."""

    model: str | None = None
    phase: Phase = Phase.DECODE
    tried: frozenset[str] = frozenset()  # upstream URLs that failed this request
    # The prompt's block hashes and who holds them: the workers' own KV block hashes and
    # the registry's index (exact), or the router's estimate (approximate); see router.prefix.
    prefix_hashes: Sequence[str] = ()
    prefix_index: PrefixIndex | None = None
    block_tokens: int = 16  # tokens per block of prefix_hashes
    # The prompt's tokens: exact when the router tokenized it, else estimated (~4 characters
    # a token); None when the request cannot be split (n > 1, several prompts).
    prompt_tokens: int | None = None
    # The prompt's token ids, when the router tokenized it the engine's way (exact) and the
    # request can be split: what a decode pod pulling a peer's prefix is given.
    prompt_token_ids: tuple[int, ...] | None = None
    # Peer fetch (`router.peer_fetch`): the fewest tokens worth pulling from a peer (None:
    # no peer fetch; the prefix scorer values what another candidate holds by the prefill a
    # pull would save), and the tokens the chosen decode pod will pull from a peer (the P/D
    # decider counts them as cached).
    peer_fetch_min_tokens: int | None = None
    peer_tokens: int = 0
    session: str | None = None  # X-Session-Id header, else the request's `user` field
    tenant: str | None = None  # the caller's tenant, named to workers (their fair share)

    def cached_tokens(self, upstream: Upstream) -> int:
        """Tokens of the prompt `upstream` (probably) holds in its prefix cache."""
        if self.prefix_index is None:
            return 0
        return self.prefix_index.match(upstream, self.prefix_hashes) * self.block_tokens

    def after_failure(self, upstream: Upstream, phase: Phase | None = None) -> RoutingContext:
        """The context of the next attempt: `upstream` is out, and the phase may change."""
        return replace(self, tried=self.tried | {upstream.url}, phase=phase or self.phase)
