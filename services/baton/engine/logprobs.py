"""Logprobs of the raw model distribution, for sampled tokens and for prompt tokens: a
table computed on the device (`logprob_table`), read back with the step's one transfer
and turned into `TokenLogprobs` on the host (`read_logprobs`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.engine.kv_connector.handoff import PullKV


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: list[tuple[int, float]]  # the `logprobs` most likely tokens, best first


def logprob_table(lp: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """lp (W, V) log-probabilities, chosen (W,) ids -> (W, 2 + 2k) float64 on the device:
    the chosen id's logprob, its rank (1 = most likely), the k best ids, their logprobs."""
    picked = lp.gather(1, chosen[:, None])  # (W, 1)
    # int32 counts: summing the bools as int64 would first copy them into a (W, V) int64
    rank = (lp > picked).sum(dim=-1, keepdim=True, dtype=torch.int32) + 1  # (W, 1)
    parts = [picked.double(), rank.double()]
    if k:
        vals, ids = lp.topk(k, dim=-1)  # (W, k)
        parts += [ids.double(), vals.double()]
    return torch.cat(parts, dim=1)


def read_logprobs(row: list[float], token: int, k: int) -> TokenLogprobs:
    """One row of a `logprob_table`, read back, keeping its first k best."""
    width = (len(row) - 2) // 2
    ids, vals = row[2:2 + width][:k], row[2 + width:][:k]
    return TokenLogprobs(token, row[0], int(row[1]), [(int(i), v) for i, v in zip(ids, vals)])


def prompt_logprob_table(logits: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """logits (P, V) at P consecutive prompt positions, `targets` (P,) the prompt token
    after each, on the device -> their `logprob_table` (P, 2 + 2k), from the raw
    distribution (as the sampled tokens' logprobs). Nothing read back."""
    return logprob_table(torch.log_softmax(logits.float(), dim=-1), targets, k)


def read_prompt_logprobs(values: list[float], targets: list[int], k: int
                         ) -> list[TokenLogprobs]:
    """A `prompt_logprob_table` read back flat (P * (2 + 2k) values) -> one TokenLogprobs
    per target."""
    width = 2 + 2 * k
    return [read_logprobs(values[j * width:(j + 1) * width], t, k)
            for j, t in enumerate(targets)]


def arrived_logprobs(req) -> TokenLogprobs | None:
    """The logprobs of a pulled request's first token (an `engine.request.Request`), as the
    prefill sampled it, when the request asks for logprobs (cut to its `logprobs` top
    entries)."""
    k = req.sampling_params.logprobs
    handoff = req.kv_handoff
    if k is None or not isinstance(handoff, PullKV):
        return None
    lp = handoff.params.first_token_logprobs
    if lp is None:
        return None
    return TokenLogprobs(handoff.params.first_token, lp.logprob, lp.rank,
                         [(t, v) for t, v in lp.top[:k]])
