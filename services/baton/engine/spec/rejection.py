"""Verification of guesses for sampled (temperature > 0) requests: rejection sampling that
leaves each token's distribution exactly the target's.

A prompt-lookup guess is a point mass q = [d]. At row i the target's distribution p_i (the
request's logit_bias, temperature, top-k, top-p and min-p applied, as the sampler does) keeps
guess d_i with probability p_i(d_i); the first guess it rejects is replaced by a draw from
the residual max(p_i - q_i, 0), i.e. p_i without d_i, renormalised; when every guess is
kept, the row after them gives a free draw from p_k. Each kept or drawn token is then
distributed as p_i exactly (Leviathan et al., 2023; vLLM's rejection sampler).

Randomness: a request with a `seed` draws from its own generator (seeded with it, kept
until the request ends), so its output is reproducible run to run; others from one
generator seeded with the engine's seed. A grammar's masks are applied to the rows first
(`verify.py`: p_i is then the masked distribution, as the sampler's). Penalties and
min_tokens bans depend on the tokens before a row or on its position: such requests never
guess (`decider.py`)."""

from __future__ import annotations

import torch

from baton.common.sampling_params import SamplingParams
from baton.engine.sampler import top_k_filter, top_p_min_p_filter

SEED_SALT = 0x5EC  # a request's verification draws differ from its sampler draws


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (n, V) -> (n, V) float32 probabilities as the sampler would draw from them
    (truncated ids at 0, renormalised)."""
    logits = logits.float()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        vals = torch.tensor(list(params.logit_bias.values()), device=logits.device)
        logits = logits.index_add(1, ids, vals[None, :].expand(logits.shape[0], -1))
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        ks = torch.full((logits.shape[0],), params.top_k, device=logits.device)
        logits = top_k_filter(logits, ks, params.top_k)
    probs = torch.softmax(logits, dim=-1)
    rows = logits.shape[0]
    probs = top_p_min_p_filter(probs, torch.full((rows,), params.top_p, device=probs.device),
                               torch.full((rows,), params.min_p, device=probs.device),
                               params.top_p < 1.0, params.min_p > 0)
    return probs / probs.sum(dim=-1, keepdim=True)


class RejectionSampler:
    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._shared: torch.Generator | None = None
        self._per_request: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    def verify(self, logits: torch.Tensor, request_id: str, params: SamplingParams,
               guesses: list[int]) -> list[int]:
        """logits (k + 1, V) of a request's last token and its k guesses -> the tokens it
        gains: the kept guesses, then one drawn token."""
        probs = target_probs(logits, params).cpu()  # (k + 1, V)
        gen = self._generator(request_id, params)
        coins = torch.rand(len(guesses), generator=gen).tolist()
        for i, guess in enumerate(guesses):
            if coins[i] < float(probs[i, guess]):
                continue
            residual = probs[i].clone()
            residual[guess] = 0.0
            if float(residual.sum()) <= 0.0:  # p_i was the point mass on the guess itself
                continue
            return guesses[:i] + [_draw(residual, gen)]
        return guesses + [_draw(probs[len(guesses)], gen)]

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            if self._shared is None:
                self._shared = torch.Generator().manual_seed(self._seed)
            return self._shared
        gen = self._per_request.get(request_id)
        if gen is None:
            gen = torch.Generator().manual_seed((params.seed ^ SEED_SALT) % 2 ** 63)
            self._per_request[request_id] = gen
        return gen


def _draw(weights: torch.Tensor, gen: torch.Generator) -> int:
    """One id drawn in proportion to `weights` (V,), not necessarily normalised."""
    return int(torch.multinomial(weights, 1, generator=gen))
