"""One step's grammar masks: filled for every constrained row in one backend call, applied
to those rows' logits only, then each constrained request's matcher takes the tokens it
gained (`advance_grammars`).

The runner fills the masks after it has launched the forward pass and before it reads the
logits: on a GPU the host computes them while the device runs the model; on CPU they cost
their time in sequence (the forward uses every core: a helper thread would only fight it).
"""

from __future__ import annotations

from collections.abc import Sequence
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

    def select(self, rows: list[int]) -> GrammarMasks | None:
        """The masks of `rows` only (indices into the same requests), renumbered as
        positions in `rows`."""
        where = {r: j for j, r in enumerate(self.rows)}
        mine = [(i, where[r]) for i, r in enumerate(rows) if r in where]
        if not mine:
            return None
        return GrammarMasks([i for i, _ in mine],
                            self.bitmask[torch.tensor([j for _, j in mine])])


def fill_grammar_masks(reqs: list[Request], ahead: Sequence[list[int]] | None = None
                       ) -> GrammarMasks | None:
    """The masks of the constrained rows among `reqs` (None when there are none); a grammar
    still waiting for its start token (`Request.grammar_after`) constrains nothing.

    `ahead[i]`: the guesses (`engine.spec`) scored before row i: that row is masked by its
    grammar as it would stand after them (a copy advanced over them; the request's own
    matcher does not move). A request with k guesses has k + 1 rows, ahead of them [],
    [g1], ..., [g1..gk]; the guesses were cut where the grammar rejects them
    (`spec.decider`), so every copy advances."""
    rows: list[int] = []
    matchers: list[GrammarMatcher] = []
    for i, r in enumerate(reqs):
        grammar = row_grammar(r, ahead[i] if ahead is not None else [])
        if grammar is not None:
            rows.append(i)
            matchers.append(grammar)
    if not rows:
        return None
    backend = matchers[0].backend  # an engine's matchers all come from its one backend
    bitmask = torch.empty(len(rows), -(-backend.vocab_size // 32), dtype=torch.int32)
    backend.fill_bitmask(matchers, bitmask)
    return GrammarMasks(rows, bitmask)


def row_grammar(req: Request, before: list[int]) -> GrammarMatcher | None:
    """The grammar that constrains the token after `before` (tokens not yet generated),
    or None: no grammar, or one still waiting for its start token then."""
    grammar = req.grammar
    if grammar is None:
        return None
    if req.grammar_after is not None:
        if req.grammar_after not in before:
            return None
        before = before[before.index(req.grammar_after) + 1:]
    return grammar.fork(before) if before else grammar


def guesses_allowed(req: Request, guesses: list[int]) -> list[int]:
    """`guesses` cut where the request's grammar would reject one (a grammar waiting for
    its start token: cut after that token, which opens it)."""
    grammar = req.grammar
    if grammar is None or not guesses:
        return guesses
    if req.grammar_after is not None:
        if req.grammar_after not in guesses:
            return guesses
        return guesses[:guesses.index(req.grammar_after) + 1]
    return guesses[:grammar.valid_prefix(guesses)]


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


def advance_grammars(reqs: Sequence[Request], sampled: dict[str, list[int]],
                     failed: dict[str, str] | None) -> None:
    """Each request's grammar takes the tokens it gained this step (`sampled`: one, or a
    verified run of guesses), in order: a grammar waiting for its start token sees them
    until it opens (it constrains the tokens after that one), an open one accepts them.
    A run is cut at the token that completes the output (a plain step would have stopped
    there). A token a grammar rejects (a matcher error) goes to `failed` (that request
    ends alone), or raises RuntimeError without `failed`."""
    for req in reqs:
        rid = req.request_id
        tokens = sampled.get(rid)
        if req.grammar is None or not tokens or (failed is not None and rid in failed):
            continue
        for i, token in enumerate(tokens):
            if req.grammar_after is not None:
                req.see_grammar_start(token)
                continue
            grammar = req.grammar
            if not grammar.accept(token):
                why = (f"structured output: token {token} rejected by the grammar: "
                       f"{grammar.error or 'no token was allowed'}")
                if failed is None:
                    raise RuntimeError(f"request {rid}: {why}")
                failed[rid] = why
                break
            if grammar.is_terminated:
                del tokens[i + 1:]
                break
