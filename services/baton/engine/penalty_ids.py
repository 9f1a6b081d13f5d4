"""The ids a step's penalised rows read: each row's output (and prompt) ids as one padded
array, for the sampler's one copy to the device (`sampler.Sampler._upload`).

Under async scheduling a request's last output token can still be pending when its next
step is launched (`request.PENDING`: its step launched, not read). When the runner takes
pending inputs from the device (`runner/ahead.py`), a penalised request's pending token is
read there too, so its step need not be synchronous: the token's cells hold `vocab` (no
id) until `with_pending` writes in the token the previous step sampled for it, on the
device. Without such a source a pending id is an error, never silently left out."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from baton.engine.request import PENDING, Request


@dataclass(frozen=True)
class PendingTokens:
    """The last step's sampled tokens on the device (`tokens`, (S,)) and each sampled
    request's row in them (`index`): where a pending output token is read from."""

    tokens: torch.Tensor
    index: dict[str, int]


def id_rows(rows: list[list[list[int]]], vocab: int) -> tuple[np.ndarray, list[int]]:
    """Each row's lists of ids, one after another, those outside [0, vocab) dropped — but a
    pending one, kept as `vocab` for `with_pending` — -> (R, L) int64 and each row's
    length. A row is padded with its own last id (0 when it has none), so a scatter of
    per-id values writes the padding's cell with the same value as the real one."""
    kept = []
    for parts in rows:
        ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
        ids = ids[((ids >= 0) & (ids < vocab)) | (ids == PENDING)]
        kept.append(np.where(ids == PENDING, vocab, ids))
    out = np.zeros((len(kept), max((len(k) for k in kept), default=0)), dtype=np.int64)
    for i, ids in enumerate(kept):
        out[i, :len(ids)] = ids
        if len(ids):
            out[i, len(ids):] = ids[-1]
    return out, [len(k) for k in kept]


def pending_sources(reqs: list[Request], pending: PendingTokens | None) -> list[int] | None:
    """Each row's place in `pending.tokens` (0 for a row with nothing pending); None when
    no row has a pending token. Raises RuntimeError for a pending token with no source."""
    waiting = [bool(r.output_token_ids) and r.output_token_ids[-1] == PENDING for r in reqs]
    if not any(waiting):
        return None
    if pending is None:
        raise RuntimeError("a penalised request's last token is pending and no launched "
                           "step's tokens were given to read it from")
    try:
        return [pending.index[r.request_id] if w else 0 for r, w in zip(reqs, waiting)]
    except KeyError as err:
        raise RuntimeError(f"request {err.args[0]!r} has a pending token the last step "
                           "did not sample") from None


def with_pending(ids: torch.Tensor, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """`ids` (P, L) with each row's pending cells (`vocab`) set to its token in `tokens`
    (P,), on the device."""
    return torch.where(ids == vocab, tokens[:, None], ids)
