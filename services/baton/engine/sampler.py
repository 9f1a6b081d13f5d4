"""Token sampling for one step: logit_bias, penalties, min_tokens, grammar masks (structured
outputs), greedy or temperature + top-k/top-p/min-p, per-request seeds, and logprobs of the
raw model distribution (of sampled tokens, and of prompt tokens: `prompt_logprobs`).

Seeded requests draw from their own generator, so their tokens do not depend on what else
is in the batch; unseeded ones share the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.engine.request import Request
from baton.engine.structured.masks import GrammarMasks, accept_sampled, apply_grammar_masks


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: list[tuple[int, float]]  # the `logprobs` most likely tokens, best first


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._shared = torch.Generator().manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, reqs: list[Request],
                 failed: dict[str, str] | None = None, masks: GrammarMasks | None = None
                 ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits (N, V) float32, one row per request -> token ids and optional logprobs.
        `logits` is not modified.

        In order: logit_bias, penalties and min_tokens bans, the grammar `masks` of the
        constrained rows (`structured.masks.fill_grammar_masks`), then temperature and
        truncation; a constrained request's matcher then takes its token.

        `failed`: when given, a row whose own settings make its part raise (a seed torch
        refuses, a banned, biased or penalised id it cannot index, a token its grammar
        rejects) is sampled without them, and its request id maps to the error in
        `failed`: the caller ends that request, the other rows are unaffected. Without it
        the error propagates."""
        logits = logits.float()
        want_logprobs = [i for i, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
        raw_logprobs = (torch.log_softmax(logits[want_logprobs], dim=-1)
                        if want_logprobs else None)  # (W, V)
        logits = self._apply_constraints(logits, reqs, failed, masks)
        tokens = torch.empty(len(reqs), dtype=torch.long)
        greedy = [i for i, r in enumerate(reqs) if r.sampling_params.is_greedy]
        rand = [i for i, r in enumerate(reqs) if not r.sampling_params.is_greedy]
        if len(greedy) == len(reqs):
            tokens = logits.argmax(dim=-1).cpu()
        elif greedy:
            tokens[greedy] = logits[greedy].argmax(dim=-1).cpu()
        if rand:
            tokens[rand] = self._sample(logits[rand], [reqs[i] for i in rand], failed).cpu()
        token_list = tokens.tolist()
        if masks is not None:
            accept_sampled(reqs, masks, token_list, failed)
        lp: list[TokenLogprobs | None] = [None] * len(reqs)
        for w, i in enumerate(want_logprobs):
            lp[i] = _logprobs(raw_logprobs[w], token_list[i], reqs[i].sampling_params.logprobs)
        return token_list, lp

    def _apply_constraints(self, logits: torch.Tensor, reqs: list[Request],
                           failed: dict[str, str] | None,
                           masks: GrammarMasks | None) -> torch.Tensor:
        """A copy of `logits` with every row's constraints applied (`logits` itself when
        no row has any)."""
        per_row = [(i, _banned_tokens(r)) for i, r in enumerate(reqs)]
        per_row = [(i, b) for i, b in per_row if b or reqs[i].sampling_params.needs_penalties]
        biased = [i for i, r in enumerate(reqs) if r.sampling_params.logit_bias]
        if not (per_row or biased or masks):
            return logits
        logits = logits.clone()
        if biased:
            _add_logit_bias(logits, reqs, biased, failed)
        for i, banned in per_row:
            req = reqs[i]
            p = req.sampling_params
            saved = logits[i].clone()
            try:
                if p.needs_penalties:
                    _apply_penalties(logits[i], req)
                if banned:
                    logits[i, banned] = float("-inf")
            except (IndexError, RuntimeError, ValueError, OverflowError) as err:
                if failed is None:
                    raise
                logits[i] = saved  # the row as the model gave it
                failed[req.request_id] = f"sampling constraints: {err}"
        if masks is not None:
            apply_grammar_masks(logits, masks)
        return logits

    def _sample(self, logits: torch.Tensor, reqs: list[Request],
                failed: dict[str, str] | None) -> torch.Tensor:
        """logits (R, V) -> (R,) sampled ids via the exponential race (argmax p / Exp(1))."""
        dev = logits.device
        temps = torch.tensor([r.sampling_params.temperature for r in reqs], device=dev)
        logits = logits / temps[:, None]
        logits = _top_k(logits, [r.sampling_params.top_k for r in reqs])
        probs = torch.softmax(logits, dim=-1)
        probs = _top_p_min_p(probs, [r.sampling_params.top_p for r in reqs],
                             [r.sampling_params.min_p for r in reqs])
        noise = torch.empty_like(probs)
        for i, req in enumerate(reqs):
            try:
                gen = self._generator(req, noise.shape[-1])
            except (RuntimeError, ValueError, OverflowError) as err:
                if failed is None:
                    raise
                failed[req.request_id] = f"seed {req.sampling_params.seed!r}: {err}"
                gen = self._shared
            noise[i].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)

    def _generator(self, req: Request, vocab: int) -> torch.Generator:
        seed = req.sampling_params.seed
        if seed is None:
            return self._shared
        gen = self._per_request.get(req.request_id)
        if gen is None:
            gen = torch.Generator().manual_seed(seed)
            skip = torch.empty(vocab)
            for _ in range(req.num_presampled):  # the draws made elsewhere, in order
                skip.exponential_(generator=gen)
            self._per_request[req.request_id] = gen
        return gen


def _add_logit_bias(logits: torch.Tensor, reqs: list[Request], rows: list[int],
                    failed: dict[str, str] | None) -> None:
    """Add each biased row's logit_bias, one scatter for the batch. A row naming an id
    outside the vocabulary (make_request refuses those) is left unbiased and failed."""
    vocab = logits.shape[-1]
    row_ids: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i in rows:
        bias = reqs[i].sampling_params.logit_bias
        bad = [t for t in bias if not 0 <= t < vocab]
        if bad:
            why = f"logit_bias: token ids {bad[:5]} are outside [0, {vocab})"
            if failed is None:
                raise IndexError(why)
            failed[reqs[i].request_id] = why
            continue
        row_ids.extend([i] * len(bias))
        cols.extend(bias)
        vals.extend(bias.values())
    if row_ids:
        dev = logits.device
        logits.index_put_((torch.tensor(row_ids, device=dev), torch.tensor(cols, device=dev)),
                          torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)


def _banned_tokens(req: Request) -> list[int]:
    """EOS and stop ids may not be sampled before min_tokens outputs exist."""
    p = req.sampling_params
    if req.num_output_tokens >= p.min_tokens:
        return []
    banned = list(p.stop_token_ids)
    if req.eos_token_id is not None and not p.ignore_eos:
        banned.append(req.eos_token_id)
    return banned


def _apply_penalties(row: torch.Tensor, req: Request) -> None:
    p = req.sampling_params
    vocab = row.shape[0]
    if p.presence_penalty or p.frequency_penalty:
        out = torch.tensor(req.output_token_ids, dtype=torch.long, device=row.device)
        counts = torch.bincount(out[out < vocab], minlength=vocab).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long, device=row.device)
        seen = seen[seen < vocab]
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)


def _top_k(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else 0 for k in ks]
    if not any(ks):
        return logits
    k_max = max(ks)
    top = logits.topk(k_max, dim=-1).values  # (R, k_max)
    idx = torch.tensor([max(k, 1) - 1 for k in ks], device=logits.device)
    thresh = top.gather(1, idx[:, None])  # (R, 1)
    thresh[torch.tensor([k == 0 for k in ks], device=logits.device)] = float("-inf")
    return logits.masked_fill(logits < thresh, float("-inf"))


def _top_p_min_p(probs: torch.Tensor, top_ps: list[float], min_ps: list[float]) -> torch.Tensor:
    dev = probs.device
    if any(p > 0 for p in min_ps):
        min_p = torch.tensor(min_ps, device=dev, dtype=probs.dtype)[:, None]
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    if any(p < 1.0 for p in top_ps):
        top_p = torch.tensor(top_ps, device=dev, dtype=probs.dtype)[:, None]
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1).
        before = sorted_p.cumsum(dim=-1) - sorted_p
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    return probs


def _logprobs(row: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    chosen = float(row[token])
    rank = int((row > row[token]).sum()) + 1
    top: list[tuple[int, float]] = []
    if k:
        vals, ids = row.topk(k)
        top = list(zip(ids.tolist(), vals.tolist()))
    return TokenLogprobs(token, chosen, rank, top)


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """logits (P, V) at P consecutive prompt positions, `targets` the prompt token after
    each -> that token's logprob, rank and the k most likely, from the raw distribution
    (as the sampled tokens' logprobs)."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # (P, V)
    tgt = torch.tensor(targets, device=lp.device)[:, None]  # (P, 1)
    chosen = lp.gather(1, tgt)  # (P, 1)
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    top: list[list[tuple[int, float]]] = [[] for _ in targets]
    if k:
        vals, ids = lp.topk(k, dim=-1)  # (P, k)
        top = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return [TokenLogprobs(t, c, r, top[j])
            for j, (t, c, r) in enumerate(zip(targets, chosen[:, 0].tolist(), ranks))]
