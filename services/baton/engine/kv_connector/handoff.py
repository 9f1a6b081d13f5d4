"""What one request asks of the KV connector: hold my KV for a puller, or pull this KV."""

from __future__ import annotations

from dataclasses import dataclass

from baton.common.internal import KVTransferParams


@dataclass(frozen=True)
class HoldKV:
    """Prefill role: when the request ends, keep its prompt's blocks under a lease and hand
    out `KVTransferParams` (on the request's final output) for a decode pod to pull them."""


@dataclass(frozen=True)
class PullKV:
    """Decode role: the prompt's KV is held by a prefill engine (`params`); pull it instead
    of computing it. `params.first_token` (sampled by the prefill) is the first output."""

    params: KVTransferParams


KVHandoff = HoldKV | PullKV
