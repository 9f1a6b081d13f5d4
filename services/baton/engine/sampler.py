"""Token sampling for one step: logit_bias, penalties, min_tokens, grammar masks (structured
outputs), greedy or temperature + top-k/top-p/min-p, per-request seeds, and logprobs of the
raw model distribution (of sampled tokens, and of prompt tokens: `prompt_logprobs`).

Three parts, so that a GPU never waits on the host mid-step:
- the host plan (`Sampler._plan`): each row's settings read and checked — a banned or
  biased id outside the vocabulary, a seed torch refuses — before any tensor is built;
- the device part (`Sampler.sample_on_device`): the plan's numbers reach the device in one
  copy (`staging.HostStaging`), then every row is constrained, truncated and drawn by
  vectorised ops with no read-back (no `.item()`, `.tolist()`, boolean-mask indexing or
  other data-dependent shape): it returns device tensors;
- the one host fetch (`fetch`): the chosen tokens, and the logprob table of the rows that
  asked (`logprobs.py`), in one device → host transfer.

Seeded requests draw from their own generator, so their tokens do not depend on what else
is in the batch; unseeded ones share the engine's generator. Generators live on the device
of the logits (one shared generator per device, made on first use; a seeded request's on
the device it first samples on, its skipped draws replayed there, so a resumed stream draws
the same numbers on the same kind of device).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from baton.engine.logprobs import TokenLogprobs, logprob_table
from baton.engine.penalty_ids import PendingTokens, id_rows, pending_sources, with_pending
from baton.engine.request import Request
from baton.engine.sample_readback import read_staged, stage
from baton.engine.staging import HostStaging
from baton.engine.structured.masks import GrammarMasks, apply_grammar_masks


@dataclass
class DeviceSample:
    """The device part's result: `tokens` (N,) int64 and, for the rows that asked for
    logprobs (`logprob_rows`, each wanting `logprob_ks` top entries), `logprobs` (W, 2 + 2K)
    float64 — the chosen token's logprob, its rank, then the K best ids and their logprobs."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None
    logprob_rows: list[int]
    logprob_ks: list[int]


@dataclass
class _Plan:
    """One step's rows as the host sees them. Rows indexed in the step's batch; a row whose
    own constraints are invalid is in `failed` and has none here."""

    rand: list[int]  # rows that sample (not greedy)
    top_k: list[int]  # per rand row, 0: off
    shared: list[int]  # positions in `rand` drawing from the shared generator
    seeded: list[tuple[int, torch.Generator | None]]  # (position in `rand`, its generator)
    shared_gen: torch.Generator | None  # None on `meta` (no values, nothing to draw)
    bias: tuple[list[int], list[int], list[float]]  # rows, ids, values
    bans: tuple[list[int], list[int]]  # rows, ids
    penalised: list[int]  # rows with penalties
    counts_on: bool  # some penalised row has a frequency or presence penalty
    repetition_on: bool  # ... a repetition penalty
    top_p_on: bool  # some rand row truncates by top_p
    min_p_on: bool  # ... by min_p
    logprob_rows: list[int]  # rows that asked for logprobs
    logprob_ks: list[int]  # how many best ids each


@dataclass
class _StepTensors:
    """The plan's numbers on the device, from one copy. Ints int64, floats float32."""

    rand: torch.Tensor  # (R,)
    top_k: torch.Tensor  # (R,)
    shared: torch.Tensor  # (U,)
    logprob_rows: torch.Tensor  # (W,)
    bias_rows: torch.Tensor  # (B,)
    bias_ids: torch.Tensor  # (B,)
    ban_rows: torch.Tensor  # (X,)
    ban_ids: torch.Tensor  # (X,)
    pen_rows: torch.Tensor  # (P,)
    outputs: torch.Tensor  # (P, Lo) output ids in the vocabulary, padded (`id_rows`)
    out_lens: torch.Tensor  # (P,) how many of a row's `outputs` are its own
    seen: torch.Tensor  # (P, Ls) prompt + output ids in the vocabulary, padded
    temperature: torch.Tensor  # (R,)
    top_p: torch.Tensor  # (R,)
    min_p: torch.Tensor  # (R,)
    bias: torch.Tensor  # (B,)
    frequency: torch.Tensor  # (P,)
    presence: torch.Tensor  # (P,)
    repetition: torch.Tensor  # (P,)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}
        self._per_request: dict[str, torch.Generator] = {}
        self._staging: dict[torch.device, HostStaging] = {}

    def release(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, reqs: list[Request],
                 failed: dict[str, str] | None = None, masks: GrammarMasks | None = None
                 ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits (N, V), one row per request -> token ids and optional logprobs. `logits`
        is not modified; the grammars do not move (the caller advances them over the
        tokens each request keeps: `structured.masks.advance_grammars`).

        `failed`: when given, a row whose own settings make its part raise (a seed torch
        refuses, a banned or biased id outside the vocabulary) is sampled without them, and
        its request id maps to the error in `failed`: the caller ends that request, the
        other rows are unaffected. Without it the error propagates."""
        return fetch(self.sample_on_device(logits, reqs, failed, masks))

    def sample_on_device(self, logits: torch.Tensor, reqs: list[Request],
                         failed: dict[str, str] | None = None,
                         masks: GrammarMasks | None = None,
                         pending: PendingTokens | None = None) -> DeviceSample:
        """The step's tokens as device tensors, nothing read back. In order: logit_bias,
        penalties and min_tokens bans, the grammar `masks` of the constrained rows
        (`structured.masks.fill_grammar_masks`), then temperature and truncation, greedy
        rows by argmax. Logprobs come from the raw distribution. `failed` as `__call__`;
        `pending`: where a penalised request's pending last token is (`penalty_ids`)."""
        logits = logits.float()  # (N, V)
        plan = self._plan(reqs, logits.shape[-1], logits.device, failed)
        if not (plan.rand or plan.logprob_rows or plan.bias[0] or plan.bans[0]
                or plan.penalised or masks):
            return DeviceSample(logits.argmax(dim=-1), None, [], [])  # all plain greedy
        t = self._upload(plan, reqs, logits.shape[-1], logits.device, pending)
        constrained = _apply_constraints(logits, plan, t, masks)
        tokens = self._choose(constrained, plan, t)  # (N,)
        table = None
        if plan.logprob_rows:
            raw = torch.log_softmax(logits.index_select(0, t.logprob_rows), dim=-1)  # (W, V)
            table = logprob_table(raw, tokens.index_select(0, t.logprob_rows),
                                  max(plan.logprob_ks))
        return DeviceSample(tokens, table, plan.logprob_rows, plan.logprob_ks)

    def _plan(self, reqs: list[Request], vocab: int, device: torch.device,
              failed: dict[str, str] | None) -> _Plan:
        ok = [i for i, r in enumerate(reqs) if _constraints_error(r, vocab, failed) is None]
        bias: tuple[list[int], list[int], list[float]] = ([], [], [])
        bans: tuple[list[int], list[int]] = ([], [])
        for i in ok:
            for tok, val in (reqs[i].sampling_params.logit_bias or {}).items():
                bias[0].append(i)
                bias[1].append(tok)
                bias[2].append(val)
            banned = _banned_tokens(reqs[i])
            bans[0].extend([i] * len(banned))
            bans[1].extend(banned)
        rand = [i for i, r in enumerate(reqs) if not r.sampling_params.is_greedy]
        shared, seeded = [], []
        for j, i in enumerate(rand):
            gen = self._seeded_generator(reqs[i], vocab, device, failed)
            if gen is None:
                shared.append(j)
            else:
                seeded.append((j, gen if device.type != "meta" else None))
        params = [reqs[i].sampling_params for i in rand]
        pen_rows = [i for i in ok if reqs[i].sampling_params.needs_penalties]
        pen = [reqs[i].sampling_params for i in pen_rows]
        logprobs: list[int] = []
        logprob_ks: list[int] = []
        for i, r in enumerate(reqs):
            if r.sampling_params.logprobs is not None:
                logprobs.append(i)
                logprob_ks.append(r.sampling_params.logprobs)
        return _Plan(
            rand, [p.top_k if 0 < p.top_k < vocab else 0 for p in params], shared, seeded,
            self._shared_generator(device), bias, bans, pen_rows,
            counts_on=any(p.frequency_penalty or p.presence_penalty for p in pen),
            repetition_on=any(p.repetition_penalty != 1.0 for p in pen),
            top_p_on=any(p.top_p < 1.0 for p in params), min_p_on=any(p.min_p > 0 for p in params),
            logprob_rows=logprobs, logprob_ks=logprob_ks)

    def _upload(self, plan: _Plan, reqs: list[Request], vocab: int, device: torch.device,
                pending: PendingTokens | None) -> _StepTensors:
        """Every number the device part needs, in one host → device copy (the penalised
        rows' pending tokens then read from `pending` on the device)."""
        pen = [reqs[i] for i in plan.penalised]
        outputs, out_lens = id_rows([[r.output_token_ids] for r in pen]
                                    if plan.counts_on else [], vocab)
        seen, seen_lens = id_rows([[r.prompt_token_ids, r.output_token_ids] for r in pen]
                                  if plan.repetition_on else [], vocab)
        sources = pending_sources(pen, pending)
        rand = [reqs[i].sampling_params for i in plan.rand]
        pen_params = [r.sampling_params for r in pen]
        ints: dict[str, Sequence[int] | np.ndarray] = {
            "rand": plan.rand, "top_k": plan.top_k, "shared": plan.shared,
            "logprob_rows": plan.logprob_rows, "bias_rows": plan.bias[0],
            "bias_ids": plan.bias[1], "ban_rows": plan.bans[0], "ban_ids": plan.bans[1],
            "pen_rows": plan.penalised, "outputs": outputs.reshape(-1),
            "out_lens": out_lens, "seen": seen.reshape(-1), "sources": sources or []}
        floats = {"temperature": [p.temperature for p in rand], "top_p": [p.top_p for p in rand],
                  "min_p": [p.min_p for p in rand], "bias": plan.bias[2],
                  "frequency": [p.frequency_penalty for p in pen_params],
                  "presence": [p.presence_penalty for p in pen_params],
                  # 1.0 (a no-op) where a row saw no id: its padding is id 0
                  "repetition": [p.repetition_penalty if n else 1.0
                                 for p, n in zip(pen_params, seen_lens)]}
        staging = self._staging.get(device)
        if staging is None:
            staging = self._staging[device] = HostStaging(device)
        parts = dict(zip([*ints, *floats], staging.pack(
            list(ints.values()), list(floats.values()), float_dtype=torch.float32)))
        parts["outputs"] = parts["outputs"].view(outputs.shape)
        parts["seen"] = parts["seen"].view(seen.shape)
        at = parts.pop("sources")
        if sources is not None:  # pending_sources raised unless `pending` is given
            assert pending is not None
            tokens = pending.tokens.index_select(0, at)  # (P,)
            for name, on in (("outputs", plan.counts_on), ("seen", plan.repetition_on)):
                if on:
                    parts[name] = with_pending(parts[name], tokens, vocab)
        return _StepTensors(**parts)

    def _choose(self, logits: torch.Tensor, plan: _Plan, t: _StepTensors) -> torch.Tensor:
        """(N, V) constrained logits -> (N,) ids: argmax for greedy rows, drawn for the
        others, merged on the device."""
        if not plan.rand:
            return logits.argmax(dim=-1)
        every = len(plan.rand) == logits.shape[0]
        sampled = self._sample(logits if every else logits.index_select(0, t.rand), plan, t)
        if every:
            return sampled
        return logits.argmax(dim=-1).index_copy_(0, t.rand, sampled)

    def _sample(self, logits: torch.Tensor, plan: _Plan, t: _StepTensors) -> torch.Tensor:
        """logits (R, V) -> (R,) sampled ids via the exponential race (argmax p / Exp(1))."""
        logits = logits / t.temperature[:, None]
        if any(plan.top_k):
            logits = top_k_filter(logits, t.top_k, max(plan.top_k))
        probs = torch.softmax(logits, dim=-1)
        probs = top_p_min_p_filter(probs, t.top_p, t.min_p, plan.top_p_on, plan.min_p_on)
        noise = torch.empty_like(probs)  # (R, V)
        if len(plan.shared) == len(plan.rand):
            noise.exponential_(generator=plan.shared_gen)
        elif plan.shared:
            drawn = torch.empty(len(plan.shared), probs.shape[-1], device=probs.device)
            noise.index_copy_(0, t.shared, drawn.exponential_(generator=plan.shared_gen))
        for j, gen in plan.seeded:
            noise[j].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)

    def _shared_generator(self, device: torch.device) -> torch.Generator | None:
        if device.type == "meta":
            return None
        gen = self._shared.get(device)
        if gen is None:
            gen = self._shared[device] = torch.Generator(device).manual_seed(self._seed)
        return gen

    def _seeded_generator(self, req: Request, vocab: int, device: torch.device,
                          failed: dict[str, str] | None) -> torch.Generator | None:
        """The request's own generator on `device` (None: it has no seed, or a seed torch
        refuses — then in `failed` — and draws from the shared one)."""
        seed = req.sampling_params.seed
        if seed is None:
            return None
        gen = self._per_request.get(req.request_id)
        if gen is not None:
            return gen
        try:  # on `meta` (no generator there) a CPU one only checks the seed
            gen = torch.Generator(device if device.type != "meta" else "cpu").manual_seed(seed)
        except (RuntimeError, ValueError, OverflowError) as err:
            if failed is None:
                raise
            failed[req.request_id] = f"seed {seed!r}: {err}"
            return None
        if device.type != "meta":
            skip = torch.empty(vocab, device=device)
            for _ in range(req.num_presampled):  # the draws made elsewhere, in order
                skip.exponential_(generator=gen)
        self._per_request[req.request_id] = gen
        return gen


def _constraints_error(req: Request, vocab: int, failed: dict[str, str] | None) -> str | None:
    """Why the row's own logit_bias or min_tokens bans cannot apply (an id outside the
    vocabulary: make_request refuses those), recorded in `failed`; raises IndexError
    without `failed`. None when they can."""
    bad_bias = [t for t in req.sampling_params.logit_bias or () if not 0 <= t < vocab]
    bad_ban = [t for t in _banned_tokens(req) if not 0 <= t < vocab]
    if not (bad_bias or bad_ban):
        return None
    why = (f"logit_bias: token ids {bad_bias[:5]} are outside [0, {vocab})" if bad_bias else
           f"sampling constraints: banned token ids {bad_ban[:5]} are outside [0, {vocab})")
    if failed is None:
        raise IndexError(f"request {req.request_id}: {why}")
    failed[req.request_id] = why
    return why


def _banned_tokens(req: Request) -> list[int]:
    """EOS and stop ids may not be sampled before min_tokens outputs exist."""
    p = req.sampling_params
    if req.num_output_tokens >= p.min_tokens:
        return []
    banned = list(p.stop_token_ids)
    if req.eos_token_id is not None and not p.ignore_eos:
        banned.append(req.eos_token_id)
    return banned


def _apply_constraints(logits: torch.Tensor, plan: _Plan, t: _StepTensors,
                       masks: GrammarMasks | None) -> torch.Tensor:
    """A copy of `logits` (N, V) with every row's constraints applied (`logits` itself
    when no row has any)."""
    if not (plan.bias[0] or plan.bans[0] or plan.penalised or masks):
        return logits
    logits = logits.clone()
    if plan.bias[0]:
        logits.index_put_((t.bias_rows, t.bias_ids), t.bias, accumulate=True)
    if plan.penalised:
        _penalise(logits, t, plan)
    if plan.bans[0]:
        logits.index_put_((t.ban_rows, t.ban_ids), logits.new_full(t.ban_ids.shape, -torch.inf))
    if masks is not None:
        apply_grammar_masks(logits, masks)
    return logits


def _penalise(logits: torch.Tensor, t: _StepTensors, plan: _Plan) -> None:
    """In place on the penalised rows of logits (N, V), touching only the ids they saw:
    frequency / presence penalties from each row's output counts, then the repetition
    penalty on every id of its prompt and output. Gathers and scatters at fixed shapes;
    a row's padding repeats one of its ids, so it writes that id's own value again."""
    vocab = logits.shape[-1]
    flat = logits.view(-1)  # (N * V,)
    base = t.pen_rows[:, None] * vocab  # (P, 1)
    if plan.counts_on:
        own = torch.arange(t.outputs.shape[1], device=logits.device) < t.out_lens[:, None]
        counts = logits.new_zeros(len(plan.penalised), vocab).scatter_add_(
            1, t.outputs, own.to(logits.dtype)).gather(1, t.outputs)  # (P, Lo)
        at = base + t.outputs  # (P, Lo)
        penalty = t.frequency[:, None] * counts + t.presence[:, None] * (counts > 0).float()
        flat.scatter_(0, at.view(-1), (flat.take(at) - penalty).view(-1))
    if plan.repetition_on:
        at = base + t.seen  # (P, Ls)
        vals = flat.take(at)
        rep = t.repetition[:, None]  # (P, 1), 1.0 on rows without one: x / 1 = x
        flat.scatter_(0, at.view(-1), torch.where(vals > 0, vals / rep, vals * rep).view(-1))


def top_k_filter(logits: torch.Tensor, ks: torch.Tensor, k_max: int) -> torch.Tensor:
    """logits (R, V), ks (R,) (0: off) -> logits below each row's k-th largest at -inf."""
    top = logits.topk(k_max, dim=-1).values  # (R, k_max)
    thresh = top.gather(1, (ks - 1).clamp(min=0)[:, None])  # (R, 1)
    thresh = torch.where(ks[:, None] > 0, thresh, -torch.inf)
    return logits.masked_fill(logits < thresh, -torch.inf)


def top_p_min_p_filter(probs: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                 top_p_on: bool, min_p_on: bool) -> torch.Tensor:
    """probs (R, V); top_p, min_p (R,) -> probs with the truncated ids at 0."""
    if min_p_on:
        floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values  # (R, 1)
        probs = probs.masked_fill(probs < floor, 0.0)
    if top_p_on:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1).
        before = sorted_p.cumsum(dim=-1) - sorted_p
        drop_sorted = before >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    return probs


def fetch(sample: DeviceSample) -> tuple[list[int], list[TokenLogprobs | None]]:
    """The step's one device → host transfer, waited for: the tokens, and the logprobs of
    the rows that asked (packed as float64 with the tokens: ids are exact in it)."""
    return read_staged(stage(sample, non_blocking=False))
