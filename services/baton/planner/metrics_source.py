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

Several routers: the URL's host is resolved to every address behind it and each is scraped
(the chart points it at a headless Service, so every router pod is read); `--metrics-url`
may also be repeated. Rates are counter deltas between two scrapes *of the same page*
divided by the time between them, summed over pages; a counter that went down (a restarted
pod) counts from zero, as Prometheus' `rate()` does. Through a ClusterIP Service successive
scrapes would land on different routers, and one router's lower counter would read as a
reset: never compare counters across pods.
"""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from baton.planner.base import MetricsError, MetricsSource, WorkloadEstimate
from baton.planner.speculation import Speculation

ROUTER_REQUESTS = "baton:router_requests_total"
WORKER_REQUESTS = "baton:requests_total"
PROMPT_TOKENS = "baton:prompt_tokens_total"
GENERATION_TOKENS = "baton:generation_tokens_total"
SPEC_ACCEPTED = "baton:spec_decode_accepted_tokens_total"
SPEC_PROPOSED = "baton:spec_decode_proposed_tokens_total"

Resolver = Callable[[str, int], list[str]]  # (host, port) -> addresses


@dataclass(frozen=True)
class Counters:
    """One scrape, summed over every series of each counter."""

    requests: float  # all requests (the rate's numerator)
    served: float  # requests that produced tokens (the means' denominator)
    prompt_tokens: float | None  # None: the page has no such series
    generation_tokens: float | None
    source: str  # "router" or "worker"
    spec_accepted: float | None = None  # None: no speculative decoding series
    spec_proposed: float | None = None


def parse_counters(text: str) -> Counters:
    """Sum the counters the planner reads; ValueError when the page is not Prometheus text,
    MetricsError when it has no request counter."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    served_router = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (ROUTER_REQUESTS, WORKER_REQUESTS, PROMPT_TOKENS,
                               GENERATION_TOKENS, SPEC_ACCEPTED, SPEC_PROPOSED):
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
                    source, sums.get(SPEC_ACCEPTED), sums.get(SPEC_PROPOSED))


@dataclass(frozen=True)
class Delta:
    """What one page's counters did between two of its scrapes."""

    requests: float
    served: float
    prompt_tokens: float | None  # None: not on both scrapes
    generation_tokens: float | None
    window_s: float
    source: str
    spec_accepted: float | None = None
    spec_proposed: float | None = None


def delta(before: Counters, after: Counters, window_s: float) -> Delta:
    """Counter increases between two scrapes of one page `window_s` seconds apart."""
    same = before.source == after.source

    def tokens(b: float | None, a: float | None) -> float | None:
        return _delta(b, a) if same and b is not None and a is not None else None

    return Delta(_delta(before.requests, after.requests), _delta(before.served, after.served),
                 tokens(before.prompt_tokens, after.prompt_tokens),
                 tokens(before.generation_tokens, after.generation_tokens), window_s,
                 after.source, tokens(before.spec_accepted, after.spec_accepted),
                 tokens(before.spec_proposed, after.spec_proposed))


def combine(deltas: list[Delta]) -> WorkloadEstimate:
    """The workload over several pages (one per router pod): rates add up, each over its own
    window; mean lengths are token totals over served totals. MetricsError when the pages
    are of different kinds (router and worker pages count different things)."""
    sources = {d.source for d in deltas}
    if len(sources) > 1:
        raise MetricsError(f"the scraped pages mix sources {sorted(sources)}: give router "
                           "pages only (or one federated page)")
    served = sum(d.served for d in deltas)

    def mean(tokens: list[float | None]) -> float | None:
        if served <= 0 or any(t is None for t in tokens):
            return None
        return sum(tokens) / served  # type: ignore[arg-type]

    return WorkloadEstimate(rate=sum(d.requests / d.window_s for d in deltas),
                            window_s=max(d.window_s for d in deltas),
                            prompt_mean=mean([d.prompt_tokens for d in deltas]),
                            output_mean=mean([d.generation_tokens for d in deltas]),
                            source=deltas[0].source, speculation=_speculation(deltas))


def _speculation(deltas: list[Delta]) -> Speculation | None:
    """What speculation did over the window, from the pages that have its counters: decode
    tokens are the generated ones less each served request's first (its prefill's)."""
    decode = accepted = proposed = 0.0
    seen = False
    for d in deltas:
        if d.spec_accepted is None or d.spec_proposed is None or d.generation_tokens is None:
            continue
        seen = True
        decode += d.generation_tokens - d.served
        accepted += d.spec_accepted
        proposed += d.spec_proposed
    return Speculation.from_counters(decode, accepted, proposed) if seen else None


def estimate(before: Counters, after: Counters, window_s: float) -> WorkloadEstimate:
    """The workload between two scrapes of one page `window_s` seconds apart."""
    return combine([delta(before, after, window_s)])


def _delta(before: float, after: float) -> float:
    return after - before if after >= before else after  # a reset counts from zero


def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (a headless Service: one per ready pod), IPv4 only
    when it has any, so a dual-stack name does not count each pod twice."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as err:
        raise MetricsError(f"cannot resolve {host!r}: {err}") from None
    # an AF_INET / AF_INET6 sockaddr starts with the address, a str (`cast`: typeshed's
    # sockaddr union also has AF_PACKET's int-first form)
    v4 = sorted({cast(str, i[4][0]) for i in infos if i[0] == socket.AF_INET})
    return v4 or sorted({cast(str, i[4][0]) for i in infos if i[0] == socket.AF_INET6})


def expand(url: str, resolve: Resolver = resolve_addresses) -> list[str]:
    """One URL per address behind `url`'s host (the URL itself for a literal address)."""
    parts = urllib.parse.urlsplit(url)
    if parts.hostname is None:
        raise MetricsError(f"{url!r} is not an http(s) URL")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    out = []
    for address in resolve(parts.hostname, port):
        host = f"[{address}]" if ":" in address else address
        netloc = f"{host}:{parts.port}" if parts.port else host
        out.append(urllib.parse.urlunsplit(parts._replace(netloc=netloc)))
    return out


class ScrapeSource(MetricsSource):
    """GETs every page behind `urls` on each `sample()`; see the module doc.

    Each URL's host is resolved on every sample and each address scraped on its own, so a
    headless Service spreads the scrape over every router pod (a ClusterIP Service would
    answer from a different pod each time). Each page keeps its own baseline: a pod's
    counters are only ever compared with that pod's, a new pod starts a baseline, a pod that
    left takes its baseline with it, and a page that fails keeps its baseline while the
    others are counted (MetricsError only when every page fails).
    """

    def __init__(self, urls: str | Sequence[str], timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic,
                 resolve: Resolver = resolve_addresses) -> None:
        self.urls = (urls,) if isinstance(urls, str) else tuple(urls)
        if not self.urls:
            raise ValueError("ScrapeSource needs at least one metrics URL")
        self.timeout_s, self._clock, self._resolve = timeout_s, clock, resolve
        self._last: dict[str, tuple[float, Counters]] = {}

    def sample(self) -> WorkloadEstimate | None:
        targets = [t for url in self.urls for t in expand(url, self._resolve)]
        pages, errors = {}, []
        for target in targets:
            try:
                pages[target] = self._scrape(target)
            except MetricsError as err:
                errors.append(str(err))
        if not pages:
            raise MetricsError("; ".join(errors) if errors else
                               f"no address behind {', '.join(self.urls)}")
        now = self._clock()
        deltas = []
        for target, counters in pages.items():
            last = self._last.get(target)
            if last is not None and now > last[0]:
                deltas.append(delta(last[1], counters, now - last[0]))
            self._last[target] = (now, counters)
        for gone in set(self._last) - set(targets):
            del self._last[gone]
        return combine(deltas) if deltas else None

    def _scrape(self, url: str) -> Counters:
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                text = response.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as err:
            raise MetricsError(f"GET {url}: HTTP {err.code} {err.reason}") from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise MetricsError(f"GET {url}: {reason}") from None
        try:
            return parse_counters(text)
        except ValueError as err:
            raise MetricsError(f"GET {url}: not a Prometheus text page ({err})") from None
