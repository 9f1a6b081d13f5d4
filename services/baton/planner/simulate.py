"""A discrete-event simulation of a disaggregated deployment: p prefill pods, d decode pods.

The model (documented choices, all conservative or neutral):

- Requests arrive as a Poisson process (`Workload.rate`), prompt and output lengths are
  lognormal with the given means, clipped to [1, max] and to the model's context window.
  The same seeded trace is replayed for every candidate (common random numbers), so that
  comparing two replica counts compares the deployments, not two samples.
- Prefill pods run the engine's steps: each step takes the waiting prompts first come first
  served up to `max_num_batched_tokens` tokens (the last one cut into a chunk that fits, its
  rest first in the next step) and costs `prefill_s` of those tokens and of their attention
  pairs; a prompt is done when the step holding its last chunk ends, so prompts batched
  together finish together. Prompts arriving during a step wait for the next. A request goes
  to the pod whose queue empties first (the least loaded).
- After prefill, the KV hand-off costs `transfer_s`, then the request waits for the decode
  pod with the fewest sequences (running + waiting). A decode pod runs continuous batching:
  each step takes `decode_step_s(batch, sum of contexts)` (piecewise linear in the batch,
  see planner.profile), every running sequence gains one token (with speculative decoding,
  `planner.speculation`: a step of b sequences costs the rows b x rows_per_step and each
  gains tokens_per_step), sequences join at step boundaries (at most `max_num_seqs` run) and
  leave when done.
- TTFT = prefill queue + prefill + transfer + decode queue (the breakdown of docs/design.md §2):
  the decode pod streams the prefill's first token when its engine takes the request in, at
  its next step boundary (it pulls the KV after that, off the TTFT path); `transfer_s` is the
  hand-off between the pods, the router's hops.
  ITL = the durations of the decode steps a sequence runs in, one sample per token.
  A request with one output token ends at prefill.

Between two events a decode pod's step times form an arithmetic series (the batch is fixed
and each sequence's context grows by one per step), so steps are advanced in closed form,
not one by one: a candidate with thousands of requests simulates in tens of milliseconds.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, replace
from typing import Protocol, cast

import numpy as np

from baton.planner.profile import DecodeCost, PrefillCost, Profile
from baton.planner.speculation import NO_SPECULATION, Speculation


@dataclass(frozen=True)
class LengthDist:
    """Lognormal token lengths with mean `mean` (the underlying normal has `sigma`), clipped
    to [1, max]. `name` only labels error messages."""

    mean: float
    sigma: float = 0.8
    max: int = 4096
    name: str = "length"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mean) and self.mean >= 1):
            raise ValueError(f"{self.name}.mean={self.mean} must be >= 1 token")
        if not (math.isfinite(self.sigma) and 0 <= self.sigma <= 4):
            raise ValueError(f"{self.name}.sigma={self.sigma} must be in [0, 4]")
        if self.max < 1:
            raise ValueError(f"{self.name}.max={self.max} must be >= 1")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        mu = math.log(self.mean) - self.sigma ** 2 / 2  # E[lognormal] = exp(mu + sigma^2/2)
        draws = rng.lognormal(mu, self.sigma, size=n)
        return np.clip(np.round(draws), 1, self.max).astype(np.int64)


@dataclass(frozen=True)
class Workload:
    rate: float  # requests per second (Poisson)
    prompt: LengthDist
    output: LengthDist
    num_requests: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"Workload.rate={self.rate} must be > 0 requests/s")
        if self.num_requests < 10:
            raise ValueError(f"Workload.num_requests={self.num_requests} must be >= 10")


@dataclass(frozen=True)
class Trace:
    arrivals: np.ndarray  # (N,) seconds, increasing
    prompt: np.ndarray  # (N,) tokens
    output: np.ndarray  # (N,) tokens, >= 1


def draw_trace(w: Workload, max_model_len: int) -> Trace:
    rng = np.random.default_rng(w.seed)
    arrivals = np.cumsum(rng.exponential(1.0 / w.rate, size=w.num_requests))
    prompt = np.minimum(w.prompt.sample(rng, w.num_requests), max_model_len - 1)
    output = np.minimum(w.output.sample(rng, w.num_requests), max_model_len - prompt)
    return Trace(arrivals, prompt, np.maximum(output, 1))


@dataclass(frozen=True)
class SimSettings:
    chunk_tokens: int  # prefill chunk = the pods' max_num_batched_tokens
    max_num_seqs: int  # decode pods' largest batch
    transfer_s: float = 0.005  # KV hand-off from prefill to decode, per request
    percentile: float = 90.0
    # The fraction of its cores a pod's threads got while they were runnable: 1 when the
    # pod has its device to itself (what a plan assumes); below 1 on a machine shared with
    # other work, as measured by `python -m benchmarks.planner_check` from the kernel's
    # run-queue accounting. Every step of that pool then takes cost / share.
    prefill_cpu_share: float = 1.0
    decode_cpu_share: float = 1.0
    # speculative decoding on the decode pods (planner.speculation); off by default
    speculation: Speculation = NO_SPECULATION

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("SimSettings.chunk_tokens and max_num_seqs must be >= 1")
        for name in ("prefill_cpu_share", "decode_cpu_share"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"SimSettings.{name}={getattr(self, name)} must be in (0, 1]")
        if not self.transfer_s >= 0:
            raise ValueError(f"SimSettings.transfer_s={self.transfer_s} must be >= 0")
        if not 0 < self.percentile < 100:
            raise ValueError(f"SimSettings.percentile={self.percentile} must be in (0, 100)")

    @classmethod
    def for_profile(cls, profile: Profile, transfer_s: float = 0.005,
                    percentile: float = 90.0, max_num_seqs: int | None = None,
                    speculation: Speculation = NO_SPECULATION) -> SimSettings:
        return cls(profile.limits.max_num_batched_tokens,
                   max_num_seqs or profile.limits.max_num_seqs, transfer_s, percentile,
                   speculation=speculation)


@dataclass(frozen=True)
class SimResult:
    prefill: int
    decode: int | None  # None: a prefill-only run (TTFT without the decode queue)
    ttft_s: float  # at the percentile
    itl_s: float | None = None  # at the percentile, token-weighted
    decode_wait_s: float | None = None  # at the percentile, over requests that decode


class JointResult(Protocol):
    """The static view of what `simulate` returns: a `SimResult` with every field set."""

    @property
    def prefill(self) -> int: ...
    @property
    def decode(self) -> int: ...
    @property
    def ttft_s(self) -> float: ...
    @property
    def itl_s(self) -> float: ...
    @property
    def decode_wait_s(self) -> float: ...


def simulate_prefill(trace: Trace, prefill: int, profile: Profile, s: SimSettings
                     ) -> SimResult:
    """The prefill pool alone: TTFT as if decode pods admitted every request at once."""
    ttft = prefill_ready_times(trace, prefill, profile, s) - trace.arrivals
    return SimResult(prefill, None, float(np.percentile(ttft, s.percentile)))


def simulate(trace: Trace, prefill: int, decode: int, profile: Profile, s: SimSettings
             ) -> JointResult:
    """Both pools together."""
    ready = prefill_ready_times(trace, prefill, profile, s)
    admitted = ready.copy()  # requests with one output token never reach decode
    log = _StepLog()
    cost = _scaled(profile.decode, s.decode_cpu_share)
    pods = [_DecodePod(cost, s.max_num_seqs, admitted, log, s.speculation)
            for _ in range(decode)]
    for i in np.argsort(ready, kind="stable"):
        if trace.output[i] < 2:
            continue
        t = float(ready[i])
        for pod in pods:
            pod.advance(t)
        min(pods, key=lambda p: p.load).add(int(i), t, int(trace.prompt[i]),
                                            int(trace.output[i]))
    for pod in pods:
        pod.advance(math.inf)
    q = s.percentile
    decoding = trace.output >= 2
    wait = admitted[decoding] - ready[decoding]
    # cast: a joint run sets decode, itl_s and decode_wait_s (only simulate_prefill leaves
    # them None); JointResult is the same object typed that way
    return cast(JointResult, SimResult(
        prefill, decode, float(np.percentile(admitted - trace.arrivals, q)),
        log.percentile(q), float(np.percentile(wait, q)) if wait.size else 0.0))


def prefill_ready_times(trace: Trace, prefill: int, profile: Profile, s: SimSettings
                        ) -> np.ndarray:
    """When each request's KV is ready on the decode side (prefill done + transfer)."""
    if prefill < 1:
        raise ValueError(f"prefill replicas={prefill} must be >= 1")
    cost = _scaled(profile.prefill, s.prefill_cpu_share)
    service = cost.chunked_seconds(trace.prompt, s.chunk_tokens)
    free = [(0.0, k) for k in range(prefill)]  # (time the pod's queue empties, pod)
    pod_of = np.empty(len(trace.arrivals), np.int64)
    for i, (arrival, seconds) in enumerate(zip(trace.arrivals.tolist(), service.tolist())):
        free_at, pod = heapq.heappop(free)
        pod_of[i] = pod
        heapq.heappush(free, (max(arrival, free_at) + seconds, pod))
    done = np.empty_like(trace.arrivals)
    for pod in range(prefill):
        mine = np.flatnonzero(pod_of == pod)
        done[mine] = batched_prefill(trace.arrivals[mine], trace.prompt[mine],
                                     cost, s.chunk_tokens)
    return done + s.transfer_s


def _scaled(cost, share: float):
    """A cost model whose every step takes 1 / share as long (`share` of the core)."""
    if share == 1.0:
        return cost
    if isinstance(cost, PrefillCost):
        return replace(cost, **{n: getattr(cost, n) / share for n in ("a", "b", "q")})
    return replace(cost, c=cost.c / share, d=cost.d / share, e=cost.e / share,
                   knots=tuple((b, t / share) for b, t in cost.knots))


def batched_prefill(arrivals: np.ndarray, prompt: np.ndarray, cost: PrefillCost,
                    budget: int) -> np.ndarray:
    """One pod's prefill steps over its requests (arrivals increasing): when each is done."""
    done = np.empty_like(arrivals)
    queue: deque[list[int]] = deque()  # [request, tokens computed so far]
    t, nxt, n = 0.0, 0, len(arrivals)
    while nxt < n or queue:
        if not queue:
            t = max(t, float(arrivals[nxt]))
        while nxt < n and arrivals[nxt] <= t:
            queue.append([nxt, 0])
            nxt += 1
        room, tokens, pairs, finished = budget, 0, 0.0, []
        for entry in queue:
            i, computed = entry
            chunk = min(int(prompt[i]) - computed, room)
            tokens += chunk
            pairs += chunk * computed + chunk * (chunk + 1) / 2  # attention inside the prompt
            room -= chunk
            entry[1] += chunk
            if entry[1] < prompt[i] or room == 0:
                if entry[1] == prompt[i]:
                    finished.append(i)
                break
            finished.append(i)
        t += cost.a + cost.b * tokens + cost.q * pairs
        for i in finished:
            done[i] = t
            queue.popleft()
    return done


class _StepLog:
    """Decode steps as arithmetic runs: `n` steps of duration alpha + beta * i, each seen
    by `batch` sequences (one ITL sample per sequence per step)."""

    def __init__(self) -> None:
        self.runs: list[tuple[float, float, int, int]] = []

    def add(self, alpha: float, beta: float, n: int, batch: int) -> None:
        self.runs.append((alpha, beta, n, batch))

    def percentile(self, q: float) -> float:
        if not self.runs:
            return 0.0
        alpha, beta, n, batch = (np.array(c) for c in zip(*self.runs))
        starts = np.cumsum(n) - n
        index = np.arange(int(n.sum())) - np.repeat(starts, n)
        durations = np.repeat(alpha, n) + np.repeat(beta, n) * index
        return weighted_percentile(durations, np.repeat(batch, n).astype(float), q)


def weighted_percentile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The smallest value whose cumulative weight reaches q% of the total."""
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[order])
    k = int(np.searchsorted(cum, q / 100.0 * cum[-1], side="left"))
    return float(values[order][min(k, len(values) - 1)])


class _DecodePod:
    """One decode pod's continuous batching, advanced by whole runs of identical batches.
    Every running sequence gains `spec.tokens_per_step` tokens a step (1 without
    speculation): `progress` counts them, and a sequence leaves once the progress since it
    joined covers its output."""

    def __init__(self, cost: DecodeCost, max_seqs: int, admitted: np.ndarray,
                 log: _StepLog, spec: Speculation = NO_SPECULATION) -> None:
        self.cost, self.max_seqs, self.admitted, self.log = cost, max_seqs, admitted, log
        self.spec = spec
        self.batch = 0  # running sequences
        self.ctx = 0.0  # sum of their contexts
        self.progress = 0.0  # tokens each running sequence gained in the steps so far
        self.start: float | None = None  # start of the step in progress; None when idle
        # heap of (progress it leaves at, progress when it joined, its prompt)
        self.leaving: list[tuple[float, float, int]] = []
        self.waiting: deque[tuple[int, int, int]] = deque()  # (request, prompt, output)

    @property
    def load(self) -> int:
        return self.batch + len(self.waiting)

    def add(self, i: int, t: float, prompt: int, output: int) -> None:
        self.waiting.append((i, prompt, output))
        if self.start is None:  # idle: the first step starts now
            self.start = t
            self._admit()

    def advance(self, t: float) -> None:
        """Run every step that ends by time `t`."""
        while self.start is not None:
            k = self._steps_until_change()
            n = self._steps_ending_within(t - self.start, k)
            if n == 0:
                return
            self._run(n)
            if n < k:
                return
            self._leave()
            self._admit()
            if self.batch == 0:
                self.start = None

    def _steps_until_change(self) -> int:
        if self.waiting and self.batch < self.max_seqs:
            return 1  # someone joins at the next boundary
        left = (self.leaving[0][0] - self.progress) / self.spec.tokens_per_step
        return max(1, math.ceil(left - EPS))

    def _coefficients(self) -> tuple[float, float]:
        """(alpha, beta): the next step's seconds, and what each later one adds (the
        contexts grow); verification rows are rows of the batch."""
        c, spec = self.cost, self.spec
        rows = self.batch * spec.rows_per_step
        return (c.batch_seconds(rows) + c.e * self.ctx,
                c.e * self.batch * spec.tokens_per_step)

    def _steps_ending_within(self, span: float, k: int) -> int:
        """The largest n <= k with n * alpha + beta * n (n - 1) / 2 <= span."""
        if span == math.inf:
            return k
        alpha, beta = self._coefficients()
        if beta > 0:
            b = alpha - beta / 2
            n = int((-b + math.sqrt(b * b + 2 * beta * max(span, 0.0))) / beta)
        else:
            n = int(max(span, 0.0) / alpha)
        n = min(max(n, 0), k)
        while n < k and _elapsed(n + 1, alpha, beta) <= span:  # rounding of the closed form
            n += 1
        while n > 0 and _elapsed(n, alpha, beta) > span:
            n -= 1
        return n

    def _run(self, n: int) -> None:
        alpha, beta = self._coefficients()
        per_token = self.spec.tokens_per_step  # ITL: a step's time over the tokens it gave
        self.log.add(alpha / per_token, beta / per_token, n, self.batch)
        assert self.start is not None  # advance runs steps only while busy
        self.start += _elapsed(n, alpha, beta)
        self.ctx += self.batch * n * per_token
        self.progress += n * per_token

    def _leave(self) -> None:
        while self.leaving and self.leaving[0][0] <= self.progress + EPS:
            _, joined, prompt = heapq.heappop(self.leaving)
            self.batch -= 1
            self.ctx -= prompt + 1 + (self.progress - joined)

    def _admit(self) -> None:
        while self.waiting and self.batch < self.max_seqs:
            i, prompt, output = self.waiting.popleft()
            self.admitted[i] = self.start
            # output - 1 decode tokens (the first came from prefill); the context starts
            # at prompt + 1 and grows with every token gained.
            heapq.heappush(self.leaving, (self.progress + output - 1, self.progress, prompt))
            self.batch += 1
            self.ctx += prompt + 1


EPS = 1e-9  # progress is a sum of floats: a sequence whose tokens are covered leaves


def _elapsed(n: int, alpha: float, beta: float) -> float:
    """Duration of n steps whose i-th (from 0) takes alpha + beta * i."""
    return n * alpha + beta * n * (n - 1) / 2
