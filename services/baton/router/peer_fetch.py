"""Peer fetch: a decode pod pulls a prompt's prefix another pod holds instead of recomputing it.

A conversation that moves between pods (its next turn went elsewhere: its pod was busy,
drained or restarted, or a new pod joined) leaves its earlier turns' KV on the pod it left.
With the registry's exact block index (`prefix.BlockIndex`) the router sees which pods hold
the prompt's leading blocks, in any tier. When another pod (prefill or decode role) holds at
least `peer_fetch_min_tokens` more of it than the decode pod picked, and the cost model says
pulling saves time (`prefix.peer_fetch_saves`: a fixed cost plus a block's transfer against
a block's prefill), the router asks that pod to lend them:

    POST /internal/prefill  {"api": "completions", "request": {"prompt": <the prefix's
                             whole blocks as token ids>, "max_tokens": 1, ...}}

The holder's prefix cache (or offload tier) has those blocks, so it computes the last one
and holds them under a lease like any prefill; the decode pod gets a `GenerateRequest` with
`peer_prefix` (the lease) and the prompt's token ids, pulls the blocks over the KV
transport (`engine.kv_connector.PullPrefix`) and prefills only the rest. A hit counts in the
request's `cached_tokens`.

Every failure ends in a local prefill, never in an error: the lend failing or answering
something else (`baton:fallbacks_total{reason="peer_fetch_failed"}`), the pull failing (the
decode pod recomputes whatever its failure policy; `peer_<reason>` in its fallbacks), the
decode pod holding the prefix by then (it releases the lease: `peer_prefix_cached`). A lease
no decode pod took over is released like a prefill's (`router.handover`). Every fetch is
counted in `baton:peer_fetches_total{result="lent"|"failed"}`.
"""

from __future__ import annotations

from collections.abc import Sequence

from baton.common.internal import KVTransferParams, OpenAIBody, PrefillRequest
from baton.common.protocol import CompletionRequest
from baton.common.roles import Role
from baton.router.discovery import Upstream
from baton.router.prefix import BlockIndex, peer_fetch_value
from baton.router.scheduling.context import RoutingContext
from baton.router.scheduling.disagg import DisaggSettings
from baton.router.scheduling.filters import FILTERS

_HOLDER_FILTERS = ("healthy", "circuit", "model")


def enabled(ctx: RoutingContext, settings: DisaggSettings) -> bool:
    """Peer fetch is on, the index is exact and the request can be split (the router has
    the prompt's token ids)."""
    return (settings.peer_fetch and ctx.prompt_token_ids is not None
            and isinstance(ctx.prefix_index, BlockIndex))


def holder(upstreams: Sequence[Upstream], pod: Upstream, ctx: RoutingContext,
           settings: DisaggSettings) -> tuple[Upstream, int] | None:
    """The other pod to pull the prompt's prefix from and the tokens it lends (whole blocks,
    short of the prompt's end), when that is worth it; else None."""
    index = ctx.prefix_index
    assert index is not None and ctx.prompt_token_ids is not None  # `enabled` said so
    pods = [u for u in upstreams if u is not pod and u.role in (Role.PREFILL, Role.DECODE)]
    for name in _HOLDER_FILTERS:
        pods = FILTERS[name](pods, ctx)
    if not pods:
        return None
    # the longest match; of equals, the least busy (its one-block prefill waits least)
    best = max(pods, key=lambda u: (index.match(u, ctx.prefix_hashes), -u.queue_depth))
    own = index.match(pod, ctx.prefix_hashes)
    # at least one prompt token is left for the decode pod to compute
    blocks = min(index.match(best, ctx.prefix_hashes),
                 (len(ctx.prompt_token_ids) - 1) // ctx.block_tokens)
    if not peer_fetch_value(blocks - own, ctx.block_tokens, settings.peer_fetch_min_tokens):
        return None  # too few tokens to gain, or the pull costs more than it saves
    return best, blocks * ctx.block_tokens


def lend_request(req: OpenAIBody, prefix: Sequence[int]) -> PrefillRequest:
    """What the holder is asked: a one-token prefill of the prefix's token ids, for the
    request's model (a LoRA adapter's blocks chain from its own root)."""
    body = CompletionRequest.model_validate({"model": req.model, "prompt": list(prefix),
                                             "max_tokens": 1, "temperature": 0})
    return PrefillRequest(api="completions", request=body)


def lent_problem(params: KVTransferParams, ids: Sequence[int], prefix: Sequence[int],
                 block_tokens: int) -> str | None:
    """What is wrong with a holder's lease for a decode pod that will pull it, or None."""
    if list(ids) != list(prefix):
        return "it lent the KV of other tokens"
    if params.num_tokens != len(prefix) or len(params.block_ids) != len(prefix) // block_tokens:
        return (f"it lent {params.num_tokens} tokens in {len(params.block_ids)} blocks for a "
                f"prefix of {len(prefix)}")
    return None
