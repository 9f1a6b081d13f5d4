"""One step's grammar masks: filled for every constrained row in one backend call, applied
to those rows' logits only, then each constrained request's matcher takes its token.

The runner fills the masks after it has launched the forward pass and before it reads the
logits: on a GPU the host computes them while the device runs the model; on CPU they cost
their time in sequence (the forward uses every core: a helper thread would only fight it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from baton.engine.request import Request

if TYPE_CHECKING:
    from baton.engine.structured.base import GrammarMatcher


@dataclass
class GrammarMasks:
    """`rows`: the sampling rows (indices into the step's requests) that are constrained;
    `bitmask` (len(rows), ceil(V / 32)) int32 on CPU, row j for `rows[j]`."""

    rows: list[int]
    bitmask: torch.Tensor


def fill_grammar_masks(reqs: list[Request]) -> GrammarMasks | None:
    """The masks of the constrained requests among `reqs` (None when there are none); a
    grammar still waiting for its start token (`Request.grammar_after`) constrains nothing."""
    rows: list[int] = []
    matchers: list[GrammarMatcher] = []
    for i, r in enumerate(reqs):
        grammar = r.active_grammar
        if grammar is not None:
            rows.append(i)
            matchers.append(grammar)
    if not rows:
        return None
    backend = matchers[0].backend  # an engine's matchers all come from its one backend
    bitmask = torch.empty(len(rows), -(-backend.vocab_size // 32), dtype=torch.int32)
    backend.fill_bitmask(matchers, bitmask)
    return GrammarMasks(rows, bitmask)


def apply_grammar_masks(logits: torch.Tensor, masks: GrammarMasks) -> None:
    """Set the disallowed ids of the constrained rows of `logits` (N, V) float32 to -inf, in
    place; other rows are untouched. Ids past the mask's vocabulary (a padded lm_head) are
    disallowed.

    Done on the floats' bits (keep & x | ~keep & -inf): integer ops vectorise where
    masked_fill with a bool mask does not (32 rows of a 49k vocabulary: ~2 ms against
    ~8 ms on our CPUs)."""
    if logits.dtype != torch.float32:
        raise TypeError(f"grammar masks apply to float32 logits, not {logits.dtype}")
    vocab = logits.shape[-1]
    rows = torch.tensor(masks.rows, device=logits.device)
    keep = keep_bits(masks.bitmask.to(logits.device, non_blocking=True), vocab)  # (R, V)
    sub = logits.index_select(0, rows)  # (R, V)
    bits = sub.view(torch.int32)
    bits.bitwise_and_(keep).bitwise_or_(keep.bitwise_not_().bitwise_and_(NEG_INF_BITS))
    logits.index_copy_(0, rows, sub)


# float32 -inf's bit pattern as an int32
NEG_INF_BITS = int(torch.tensor(float("-inf")).view(torch.int32))


def keep_bits(packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """(R, W) int32 bit rows -> (R, vocab) int32, -1 (all bits set) where bit t % 32 of
    word t // 32 allows id t, else 0; ids past 32 W are 0. On the tensor's device."""
    rows, words = packed.shape
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    keep = ((packed.unsqueeze(-1) >> shifts) & 1).neg_().view(rows, words * 32)  # (R, 32 W)
    if words * 32 >= vocab:
        return keep[:, :vocab]
    pad = torch.zeros(rows, vocab - words * 32, dtype=torch.int32, device=packed.device)
    return torch.cat([keep, pad], dim=1)


def see_grammar_starts(reqs: list[Request], tokens: list[int]) -> None:
    """Each request whose grammar waits for its start token (a reasoning model's end of
    thinking) sees its sampled token; the grammar constrains the tokens after that one.
    Called after `accept_sampled`, so a grammar opened here takes no token this step."""
    for req, token in zip(reqs, tokens):
        if req.grammar_after is not None:
            req.see_grammar_start(token)


def accept_sampled(reqs: list[Request], masks: GrammarMasks, tokens: list[int],
                   failed: dict[str, str] | None) -> None:
    """Each constrained request's matcher takes its sampled token. A token its grammar
    rejects (a matcher error) goes to `failed` (that request ends alone), or raises
    RuntimeError without `failed`."""
    for i in masks.rows:
        req = reqs[i]
        if failed is not None and req.request_id in failed:
            continue  # it ends this step anyway
        grammar = req.grammar
        assert grammar is not None  # masks.rows are the rows of reqs with a grammar
        if not grammar.accept(tokens[i]):
            why = (f"structured output: token {tokens[i]} rejected by the grammar: "
                   f"{grammar.error or 'no token was allowed'}")
            if failed is None:
                raise RuntimeError(f"request {req.request_id}: {why}")
            failed[req.request_id] = why
