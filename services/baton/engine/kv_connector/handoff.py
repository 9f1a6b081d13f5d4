"""What one request asks of the KV connector: hold my KV for a puller, pull this KV, or pull a
peer's copy of my prompt's prefix."""

from __future__ import annotations

from dataclasses import dataclass

from baton.common.internal import KVTransferParams


@dataclass(frozen=True)
class HoldKV:
    """Prefill role: when the request ends, keep its prompt's blocks under a lease and hand
    out `KVTransferParams` (on the request's final output) for a decode pod to pull them.
    `peer`: another pod lends the prompt's first tokens (as a `PullPrefix` would pull them):
    pull those first, compute the rest, then hold the whole prompt."""

    peer: KVTransferParams | None = None


@dataclass(frozen=True)
class PullKV:
    """Decode role: the prompt's KV is held by a prefill engine (`params`); pull it instead
    of computing it. `params.first_token` (sampled by the prefill) is the first output."""

    params: KVTransferParams

    def check(self, num_prompt_tokens: int, num_prompt_blocks: int, vocab_size: int) -> None:
        """Raise ValueError unless the held KV covers exactly this prompt (tokens and
        blocks of this engine's size) and the first token is in the vocabulary."""
        p = self.params
        if p.num_tokens != num_prompt_tokens or len(p.block_ids) != num_prompt_blocks:
            raise ValueError(f"kv_transfer_params cover {p.num_tokens} tokens in "
                             f"{len(p.block_ids)} blocks, the prompt has {num_prompt_tokens} "
                             f"tokens ({num_prompt_blocks} blocks)")
        if p.first_token >= vocab_size:
            raise ValueError(f"first_token {p.first_token} is outside [0, {vocab_size})")


@dataclass(frozen=True)
class PullPrefix:
    """Any engine with a KV transport: the first `params.num_tokens` tokens of the prompt
    (whole blocks, fewer than the prompt) are held by a peer that computed them before (a
    conversation's earlier turns, on the pod it moved from); pull their KV and compute the
    rest here. No first token comes with it. A pull that fails always recomputes: the peer's
    copy only saves work (`engine.kv_connector.transport`)."""

    params: KVTransferParams


def check_peer_prefix(p: KVTransferParams, num_prompt_tokens: int, block_size: int) -> None:
    """Raise ValueError unless a peer's lease is a whole-block prefix of this prompt, short
    of its end, in blocks of this engine's size."""
    if p.num_tokens % block_size or p.num_tokens >= num_prompt_tokens:
        raise ValueError(f"a peer's prefix covers {p.num_tokens} tokens: it must be whole "
                         f"blocks of {block_size} tokens, fewer than the prompt's "
                         f"{num_prompt_tokens}")
    if len(p.block_ids) != p.num_tokens // block_size:
        raise ValueError(f"a peer's prefix of {p.num_tokens} tokens comes in "
                         f"{len(p.block_ids)} blocks, not {p.num_tokens // block_size}")


KVHandoff = HoldKV | PullKV | PullPrefix


def peer_prefix(handoff: KVHandoff | None) -> KVTransferParams | None:
    """The peer's lease a request pulls its prompt's prefix from first, if any."""
    if isinstance(handoff, PullPrefix):
        return handoff.params
    if isinstance(handoff, HoldKV):
        return handoff.peer
    return None


def after_load(handoff: KVHandoff | None) -> KVHandoff | None:
    """What a request asks of the connector once its load ended (done, or given up for a
    local prefill): a prefill still holds its KV at its end; a pull asks nothing more."""
    return HoldKV() if isinstance(handoff, HoldKV) else None
