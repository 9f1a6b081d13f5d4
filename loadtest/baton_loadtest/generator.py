"""Turn a WorkloadSpec into concrete requests: real text of the sampled token lengths, and
when each request is sent.

Request `i` is a pure function of (seed, i), so a closed-loop run of unknown length draws as
many as it needs and two runs of one spec send the same prompts. Prompt text is cut from
real English (Python's standard-library documentation, offline everywhere) at a random
place, `n` tokens long for the target tokenizer.

Sessions are multi-turn conversations replayed from a script: turn k carries the previous
turns (user text and a recorded assistant answer of the sampled output length), so its
prefix is the previous turn's whole prompt, and it is sent `think_time_s` after the previous
turn's answer ended.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from baton_loadtest.grounded import grounded_message
from baton_loadtest.spec import ArrivalSpec, LengthSpec, WorkloadSpec
from baton_loadtest.workload import corpus_token_ids


def sample_lengths(spec: LengthSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    if spec.dist == "fixed":
        return np.full(n, spec.value, dtype=int)
    if spec.dist == "uniform":
        return rng.integers(spec.min, spec.max + 1, size=n)
    draws = rng.lognormal(np.log(spec.median), spec.sigma, size=n)
    return np.clip(np.round(draws), spec.min, spec.max).astype(int)


def arrival_times(spec: ArrivalSpec, rng: np.random.Generator, n: int | None = None,
                  duration_s: float | None = None) -> list[float]:
    """Send offsets in seconds from the start, for open-loop processes: `n` of them, or as
    many as fall inside `duration_s`."""
    if spec.process == "closed":
        raise ValueError("a closed loop has no arrival times")
    if spec.process == "step":
        # Each rate holds step_s seconds (the last one holds on when a count asks for more).
        steps = len(spec.rates)
        horizon = duration_s if duration_s is not None else (
            None if n is not None else steps * spec.step_s)
        out, t = [], 0.0
        while n is None or len(out) < n:
            t += rng.exponential(1.0 / spec.rates[min(int(t // spec.step_s), steps - 1)])
            if horizon is not None and t >= horizon:
                break
            out.append(t)
        return out
    limit = n if n is not None else int(spec.rate * duration_s * 3 + 100)
    if spec.process == "poisson":
        gaps = rng.exponential(1.0 / spec.rate, size=limit)
    else:  # gamma: mean 1/rate, coefficient of variation 1/sqrt(burstiness)
        k = spec.burstiness
        gaps = rng.gamma(k, 1.0 / (spec.rate * k), size=limit)
    times = np.cumsum(gaps)
    if duration_s is not None:
        times = times[times < duration_s]
    return times.tolist()


@dataclass
class PlannedRequest:
    index: int
    messages: list[dict]  # chat form; completions join them into `prompt`
    prompt: str
    max_tokens: int
    arrival_s: float | None = None  # open loop: offset from the start
    after: int | None = None  # session turn: sent after this request ended...
    think_time_s: float = 0.0  # ...plus this long
    session: int | None = None


class RequestFactory:
    """Deterministic requests for one spec and tokenizer."""

    def __init__(self, spec: WorkloadSpec, tokenizer) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.corpus = corpus_token_ids(tokenizer)
        rng = np.random.default_rng([spec.seed, 0])
        self.system = (self._text(rng, spec.system_prompt_tokens)
                       if spec.system_prompt_tokens else None)

    def _user(self, rng: np.random.Generator, n: int) -> str:
        """A user turn of about n tokens: corpus text, or a grounded ask and its passage."""
        if self.spec.content == "grounded":
            return grounded_message(rng, (max(200, 3 * n), max(400, 5 * n)))
        return self._text(rng, n)

    def _text(self, rng: np.random.Generator, n: int) -> str:
        start = int(rng.integers(0, len(self.corpus)))
        ids = [self.corpus[(start + i) % len(self.corpus)] for i in range(n)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _lengths(self, rng: np.random.Generator) -> tuple[int, int]:
        p = int(sample_lengths(self.spec.prompt_tokens, 1, rng)[0])
        o = int(sample_lengths(self.spec.output_tokens, 1, rng)[0])
        return p, o

    def _head(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def request(self, i: int) -> PlannedRequest:
        """Independent request i."""
        rng = np.random.default_rng([self.spec.seed, 1, i])
        p, o = self._lengths(rng)
        messages = self._head() + [{"role": "user", "content": self._user(rng, p)}]
        return PlannedRequest(i, messages, _join(messages), o)

    def session(self, s: int, first_index: int) -> list[PlannedRequest]:
        """The turns of conversation s, indexed from first_index."""
        rng = np.random.default_rng([self.spec.seed, 2, s])
        history = self._head()
        turns = []
        for t in range(self.spec.sessions.turns):
            p, o = self._lengths(rng)
            history = history + [{"role": "user", "content": self._user(rng, p)}]
            idx = first_index + t
            turns.append(PlannedRequest(
                idx, list(history), _join(history), o, session=s,
                after=idx - 1 if t else None,
                think_time_s=self.spec.sessions.think_time_s if t else 0.0))
            history = history + [{"role": "assistant", "content": self._text(rng, o)}]
        return turns


def plan(spec: WorkloadSpec, tokenizer) -> tuple[list[PlannedRequest], RequestFactory]:
    """The requests of an open-loop run, or of a closed-loop run with a request count.
    A closed-loop run with a duration draws from the factory as it goes (empty list)."""
    factory = RequestFactory(spec, tokenizer)
    rng = np.random.default_rng([spec.seed, 3])
    closed = spec.arrival.process == "closed"
    if spec.sessions.count:
        reqs: list[PlannedRequest] = []
        for s in range(spec.sessions.count):
            reqs += factory.session(s, len(reqs))
        if spec.num_requests is not None:
            reqs = reqs[:spec.num_requests]
        starts = [r for r in reqs if r.after is None]
        for r, t in zip(starts, arrival_times(spec.arrival, rng, n=len(starts))):
            r.arrival_s = t
        return reqs, factory
    if closed:
        n = spec.num_requests or 0
        return [factory.request(i) for i in range(n)], factory
    times = arrival_times(spec.arrival, rng, n=spec.num_requests, duration_s=spec.duration_s)
    reqs = [factory.request(i) for i in range(len(times))]
    for r, t in zip(reqs, times):
        r.arrival_s = t
    return reqs, factory


def _join(messages: list[dict]) -> str:
    return "\n\n".join(m["content"] for m in messages)
