"""Verification: the target model scored a request's last known token and its k guesses as
one chunk, so its distribution at row i is the one it would have had after the guesses
before i.

Greedy requests keep their guesses while they equal the target's argmax; the first row that
disagrees (or the row after the last guess) gives the target's own next token — exactly
what k + 1 plain decode steps would have produced. Sampled requests go through rejection
sampling (`rejection.py`), which keeps every token distributed as the target's."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from baton.engine.logprobs import TokenLogprobs, logprob_table, read_logprobs
from baton.engine.scheduler.output import ScheduledRequest
from baton.engine.spec.rejection import RejectionSampler
from baton.engine.structured.masks import GrammarMasks, apply_grammar_masks


def accepted_run(guesses: list[int], targets: list[int]) -> int:
    """How many of `guesses` the target's tokens (`targets`, one more than guesses) keep."""
    n = 0
    while n < len(guesses) and guesses[n] == targets[n]:
        n += 1
    return n


def by_rejection(entry: ScheduledRequest) -> bool:
    """Whether `entry`'s guesses are verified by rejection sampling (a sampled request)."""
    return bool(entry.spec_token_ids) and not entry.request.sampling_params.is_greedy


def sampler_rows(entries: list[ScheduledRequest]) -> list[int]:
    """The logits rows the sampler draws (all but those verified by rejection sampling)."""
    rows: list[int] = []
    row = 0
    for s in entries:
        if not by_rejection(s):
            rows += range(row, row + s.num_sampled)
        row += s.num_sampled
    return rows


@dataclass
class Verified:
    """What a step's sampling rows give, by request id: the tokens gained, their logprobs,
    the requests whose own settings failed, and (guesses, accepted) per guessing request."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    guessed: dict[str, tuple[int, int]] = field(default_factory=dict)


def verify(entries: list[ScheduledRequest], logits: torch.Tensor, tokens: list[int],
           logprobs: list[TokenLogprobs | None], failed: dict[str, str],
           rejection: RejectionSampler, masks: GrammarMasks | None = None) -> Verified:
    """Turn a step's rows into each request's tokens. `logits` (N, V): every sampling row;
    `tokens` / `logprobs`: the sampler's draws for `sampler_rows(entries)`, in order;
    `failed`: the requests whose sampling settings failed there; `masks`: the grammar
    masks of every sampling row (the rows verified by rejection sampling draw under them;
    their logprobs, as the sampler's, come from the raw distribution)."""
    out = Verified(failed=failed)
    masked = logits
    if masks is not None and any(by_rejection(s) for s in entries):
        masked = logits.to(torch.float32, copy=True)  # (N, V)
        apply_grammar_masks(masked, masks)
    row = drawn = 0
    for s in entries:
        rid, guesses, n = s.request.request_id, s.spec_token_ids, s.num_sampled
        if by_rejection(s):
            params = s.request.sampling_params
            kept = rejection.verify(masked[row:row + n], rid, params, guesses)
            lps = _logprobs(logits[row:row + len(kept)], kept, params.logprobs)
        else:
            targets = tokens[drawn:drawn + n]
            kept = targets[:accepted_run(guesses, targets) + 1]
            lps = [lp for lp in logprobs[drawn:drawn + len(kept)] if lp is not None]
            drawn += n
        if guesses:
            out.guessed[rid] = (len(guesses), len(kept) - 1)
        if rid not in failed:
            out.sampled[rid] = kept
            if lps:
                out.logprobs[rid] = lps
        row += n
    return out


def _logprobs(logits: torch.Tensor, tokens: list[int], k: int | None) -> list[TokenLogprobs]:
    """The logprobs of `tokens` from the raw distribution of their rows (as the sampler's)."""
    if k is None:
        return []
    chosen = torch.tensor(tokens, device=logits.device)
    table = logprob_table(torch.log_softmax(logits.float(), dim=-1), chosen, k).tolist()
    return [read_logprobs(row, t, k) for row, t in zip(table, tokens)]
