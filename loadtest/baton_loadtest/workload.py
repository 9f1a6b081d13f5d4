"""Seeded synthetic workloads with realistic length distributions.

Prompts are real English text (Python's own standard-library documentation, available
offline everywhere) cut to the requested number of tokens for the target tokenizer, so a
benchmark never replays identical short prompts.
"""

from __future__ import annotations

import pydoc
from dataclasses import dataclass

import numpy as np

_CORPUS_MODULES = ("argparse", "asyncio", "collections", "contextlib", "dataclasses",
                   "functools", "itertools", "json", "logging", "pathlib", "re", "socket",
                   "subprocess", "threading", "typing", "unittest", "email", "http.client")


@dataclass(frozen=True)
class LengthDist:
    """Lognormal with the given median, clipped to [low, high]."""

    median: float
    sigma: float
    low: int
    high: int

    def sample(self, n: int, rng: np.random.Generator) -> list[int]:
        draws = rng.lognormal(np.log(self.median), self.sigma, size=n)
        return np.clip(np.round(draws), self.low, self.high).astype(int).tolist()


@dataclass(frozen=True)
class OfflineRequest:
    prompt_token_ids: list[int]
    max_tokens: int


CHAT_PROMPTS = LengthDist(median=150, sigma=0.9, low=8, high=1024)
CHAT_OUTPUTS = LengthDist(median=100, sigma=0.6, low=4, high=512)


def corpus_token_ids(tokenizer) -> list[int]:
    text = "\n\n".join(pydoc.getdoc(pydoc.locate(m)) or "" for m in _CORPUS_MODULES)
    return tokenizer.encode(text)


def chat_workload(tokenizer, num_requests: int = 64, seed: int = 0,
                  prompts: LengthDist = CHAT_PROMPTS, outputs: LengthDist = CHAT_OUTPUTS
                  ) -> list[OfflineRequest]:
    rng = np.random.default_rng(seed)
    corpus = corpus_token_ids(tokenizer)
    p_lens, o_lens = prompts.sample(num_requests, rng), outputs.sample(num_requests, rng)
    reqs = []
    for p_len, o_len in zip(p_lens, o_lens):
        start = int(rng.integers(0, len(corpus)))
        ids = [corpus[(start + i) % len(corpus)] for i in range(p_len)]
        reqs.append(OfflineRequest(ids, o_len))
    return reqs
