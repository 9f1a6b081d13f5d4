"""`ScrapeSource`: the live workload from a Prometheus text page (`MetricsSource`).

Which page, and what it gives:

- the router's /metrics (the normal `--metrics-url`): `baton:router_requests_total{code}`
  gives the request rate (every code counts: a refused request is demand too). Lengths are
  not on this page, so the planner keeps its configured length distributions.
- a worker's /metrics, or a federated page holding the workers' series (with or without
  the router's): `baton:prompt_tokens_total` and `baton:generation_tokens_total`, summed
  over every series on the page, give the mean prompt and output tokens per served request
  (served = router answers with a 2xx code, or the workers' `baton:requests_total` when the
  page has no router series; the rate then comes from `baton:requests_total` too).
  Prompt tokens are those *computed* (prefix-cache hits excluded), which is the prefill work
  the planner sizes for; the first token sampled on a prefill pod counts as generated there,
  so the sum over pods is every output token once.

  On a page federating prefill *and* decode workers without the router, a disaggregated
  request finishes on both pods and `baton:requests_total` counts it twice: point the URL
  at the router (or at a federation that includes it) in that case.

Rates are counter deltas between two scrapes divided by the time between them; a counter
that went down (a restarted pod) counts from zero, as Prometheus' `rate()` does.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from baton.planner.base import MetricsError, MetricsSource, WorkloadEstimate

ROUTER_REQUESTS = "baton:router_requests_total"
WORKER_REQUESTS = "baton:requests_total"
PROMPT_TOKENS = "baton:prompt_tokens_total"
GENERATION_TOKENS = "baton:generation_tokens_total"


@dataclass(frozen=True)
class Counters:
    """One scrape, summed over every series of each counter."""

    requests: float  # all requests (the rate's numerator)
    served: float  # requests that produced tokens (the means' denominator)
    prompt_tokens: float | None  # None: the page has no such series
    generation_tokens: float | None
    source: str  # "router" or "worker"


def parse_counters(text: str) -> Counters:
    """Sum the counters the planner reads; ValueError when the page is not Prometheus text,
    MetricsError when it has no request counter."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    served_router = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (ROUTER_REQUESTS, WORKER_REQUESTS, PROMPT_TOKENS,
                               GENERATION_TOKENS):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
                if sample.name == ROUTER_REQUESTS and sample.labels.get("code", "")[:1] == "2":
                    served_router += sample.value
    if ROUTER_REQUESTS in sums:
        requests, served, source = sums[ROUTER_REQUESTS], served_router, "router"
    elif WORKER_REQUESTS in sums:
        requests = served = sums[WORKER_REQUESTS]
        source = "worker"
    else:
        raise MetricsError(f"the page has neither {ROUTER_REQUESTS} nor {WORKER_REQUESTS}: "
                           "is the URL the router's (or a worker's) /metrics?")
    return Counters(requests, served, sums.get(PROMPT_TOKENS), sums.get(GENERATION_TOKENS),
                    source)


def estimate(before: Counters, after: Counters, window_s: float) -> WorkloadEstimate:
    """The workload between two scrapes `window_s` seconds apart."""
    served = _delta(before.served, after.served)
    prompt = output = None
    if served > 0 and before.source == after.source:
        if before.prompt_tokens is not None and after.prompt_tokens is not None:
            prompt = _delta(before.prompt_tokens, after.prompt_tokens) / served
        if before.generation_tokens is not None and after.generation_tokens is not None:
            output = _delta(before.generation_tokens, after.generation_tokens) / served
    return WorkloadEstimate(rate=_delta(before.requests, after.requests) / window_s,
                            window_s=window_s, prompt_mean=prompt, output_mean=output,
                            source=after.source)


def _delta(before: float, after: float) -> float:
    return after - before if after >= before else after  # a reset counts from zero


class ScrapeSource(MetricsSource):
    """GETs `url` (a Prometheus text page) on each `sample()`; see the module doc."""

    def __init__(self, url: str, timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url, self.timeout_s, self._clock = url, timeout_s, clock
        self._last: tuple[float, Counters] | None = None

    def sample(self) -> WorkloadEstimate | None:
        counters = self._scrape()
        now = self._clock()
        last, self._last = self._last, (now, counters)
        if last is None or now <= last[0]:
            return None
        return estimate(last[1], counters, now - last[0])

    def _scrape(self) -> Counters:
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as response:
                text = response.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as err:
            raise MetricsError(f"GET {self.url}: HTTP {err.code} {err.reason}") from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise MetricsError(f"GET {self.url}: {reason}") from None
        try:
            return parse_counters(text)
        except ValueError as err:
            raise MetricsError(f"GET {self.url}: not a Prometheus text page ({err})") from None
