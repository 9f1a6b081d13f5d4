"""Prometheus metrics of the services, named `baton:<thing>_<unit>` (docs/design.md §8).

Each service owns a `CollectorRegistry` (several apps can live in one test process). Engine
counters and gauges are read from the engine at scrape time by a collector, so the engine
loop never touches Prometheus; latency histograms are observed by the serving layer.

Note: `promtool check metrics` reports "metric names should not contain ':'" for every
name here, and "non-counter metrics should not have _total suffix" for the gauge
`baton:kv_blocks_total`; both names are the contract (dashboards depend on them, as on
vLLM's `vllm:` names), and these are the only findings our pages may trigger (tested).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from baton.common.stats import EngineStats, SpecStats

prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # unannotated upstream

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0,
               120.0, 240.0, 480.0, 960.0)
HOP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
               5.0, 10.0, 30.0, 60.0)


def render(registry: CollectorRegistry) -> bytes:
    return prometheus_client.generate_latest(registry)


class ConfigMetrics:
    """Reloads of the tuning ConfigMap (`common.tuning`), on every service."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.config_reloads = Counter("baton:config_reloads", "Reloads of the tuning config "
                                      "file, by result.", ["result"], registry=registry)
        self.config_restart_pending = Gauge(
            "baton:config_restart_pending", "1 when the tuning file changed a knob that only "
            "takes effect after a restart.", registry=registry)

    def reloaded(self, result: str) -> None:
        self.config_reloads.labels(result).inc()


class WorkerMetrics(ConfigMetrics):
    """Per-request latencies and outcomes, plus the engine's own state via `snapshot`."""

    def __init__(self, snapshot: Callable[[], EngineStats | None] | None = None,
                 lora: Callable[[], LoRACounts | None] | None = None) -> None:
        """`snapshot`: the engine's stats; `lora`: its LoRA adapters' counters (None
        before the engine loads, or without LoRA)."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        super().__init__(r)
        self.ttft = Histogram("baton:time_to_first_token_seconds",
                              "Time from request arrival to its first output token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("baton:inter_token_latency_seconds",
                             "Time between consecutive output tokens of one request.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("baton:e2e_request_latency_seconds",
                             "Time from request arrival to its last output token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("baton:queue_time_seconds",
                                    "Time a request waited before it was first scheduled.",
                                    buckets=TTFT_BUCKETS, registry=r)
        self.requests = Counter("baton:requests", "Finished engine requests by finish reason.",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("baton:requests_rejected",
                                "Requests refused before they reached the engine, by reason.",
                                ["reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self.requests.labels(reason)
        self.kv_transfer_seconds = Histogram(
            "baton:kv_transfer_seconds", "Duration of KV pulls (decode side).",
            buckets=HOP_BUCKETS, registry=r)
        if snapshot is not None:
            r.register(EngineCollector(snapshot))
        if lora is not None:
            r.register(LoRACollector(lora))


# name -> (kind, help); `EngineStats.series()` gives a value for each name.
ENGINE_SERIES = {
    "baton:num_requests_running": ("gauge", "Requests in the running batch."),
    "baton:num_requests_waiting": ("gauge", "Requests waiting to be scheduled."),
    "baton:kv_blocks_used": ("gauge", "KV cache blocks held by requests."),
    "baton:kv_blocks_total": ("gauge", "KV cache blocks in the pool."),
    "baton:kv_cache_usage_ratio": ("gauge", "Fraction of KV cache blocks in use."),
    "baton:prompt_tokens_total": ("counter", "Prompt tokens computed (prefix-cache hits "
                                  "excluded)."),
    "baton:generation_tokens_total": ("counter", "Output tokens generated."),
    "baton:prefix_cache_hit_tokens_total": ("counter", "Prompt tokens served from the "
                                            "prefix cache."),
    "baton:preemptions_total": ("counter", "Requests preempted (their KV recomputed later)."),
    "baton:kv_transfer_bytes_total": ("counter", "KV bytes pulled from prefill workers."),
    "baton:kv_transfer_failures_total": ("counter", "KV pulls that failed."),
    "baton:kv_leases_held": ("gauge", "Prefilled requests whose blocks wait for a pull."),
    "baton:kv_offload_hit_blocks_total": ("counter", "KV blocks of prompts loaded back from "
                                          "the host offload tier."),
    "baton:kv_offload_hit_tokens_total": ("counter", "Prompt tokens served from the host "
                                          "offload tier (not recomputed)."),
    "baton:kv_offload_bytes_total": ("counter", "KV bytes copied from the device pool to "
                                     "the host offload tier."),
    "baton:kv_offload_loaded_bytes_total": ("counter", "KV bytes copied from the host "
                                            "offload tier back to the device pool."),
    "baton:kv_offload_skipped_total": ("counter", "Evicted KV blocks not offloaded: past "
                                       "the per-step bound on offload copies."),
    "baton:kv_offload_blocks_held": ("gauge", "KV blocks held by the host offload tier."),
    "baton:kv_offload_capacity_blocks": ("gauge", "KV blocks the host offload tier can hold."),
    "baton:kv_offload_queue_depth": ("gauge", "Offload copies the last step's evictions "
                                     "queued."),
    "baton:kv_offload_disk_read_blocks_total": ("counter", "KV blocks read back from the "
                                                "disk tier into the host tier."),
    "baton:kv_offload_disk_written_blocks_total": ("counter", "KV blocks written to the "
                                                   "disk tier."),
    "baton:kv_offload_disk_blocks_held": ("gauge", "KV blocks held by the disk tier."),
    "baton:kv_offload_disk_queue_depth": ("gauge", "Disk tier reads and writes queued on "
                                          "its worker thread."),
    "baton:kv_offload_disk_spills_dropped_total": ("counter", "KV blocks the host tier "
                                                   "evicted that never reached the disk "
                                                   "tier: its write queue was full, or the "
                                                   "write failed."),
    "baton:kv_offload_disk_read_failures_total": ("counter", "Disk tier reads that found "
                                                  "the block missing or damaged."),
    "baton:kv_offload_load_fallbacks_total": ("counter", "Offload tier loads that failed; "
                                              "the request computed those tokens."),
    "baton:kv_offload_load_queue_blocks": ("gauge", "KV blocks admitted requests still "
                                           "wait to load from the offload tiers (a step "
                                           "copies a bounded number)."),
}


class EngineCollector(Collector):
    """The engine's stats as Prometheus series at each scrape (none before it loads)."""

    def __init__(self, snapshot: Callable[[], EngineStats | None]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        stats = self._snapshot()
        if stats is None:
            return
        if stats.kv_transfer is not None:
            family = CounterMetricFamily("baton:fallbacks", "Requests that fell back to local "
                                         "prefill, by reason.", labels=["reason"])
            for reason, count in sorted(stats.kv_transfer.fallbacks.items()):
                family.add_metric([reason], count)
            yield family
        if stats.spec is not None:
            yield from _spec_families(stats.spec)
        if stats.timing is not None:
            yield from stats.timing.families()
        values = stats.series()
        for name, (kind, doc) in ENGINE_SERIES.items():
            if name not in values:
                continue
            if kind == "gauge":
                yield GaugeMetricFamily(name, doc, value=values[name])
            else:
                yield CounterMetricFamily(name.removesuffix("_total"), doc, value=values[name])


# kind -> adapter -> count (`engine.lora.stats.LoRACounters.snapshot`)
LoRACounts = dict[str, dict[str, int]]
# the counters' series: name -> (its second label, the counters' kinds by that label's
# value; or no second label and one kind), help
LORA_SERIES: dict[str, tuple[str | None, dict[str, str], str]] = {
    "baton:lora_requests": (None, {"": "requests"}, "Requests served with each LoRA adapter."),
    "baton:lora_tokens": ("kind", {"prompt": "prompt_tokens", "generation": "generation_tokens"},
                          "Prompt tokens of finished requests and generated tokens, by LoRA "
                          "adapter."),
    "baton:lora_loads": ("tier", {"host": "host_loads", "device": "loads"},
                         "LoRA adapter copies made: read from disk into host memory (host), "
                         "copied into a resident slot (device)."),
    "baton:lora_evictions": ("tier", {"host": "host_evictions", "device": "evictions"},
                             "LoRA adapter copies dropped: host copies beyond "
                             "--max-cpu-loras (host), resident slots beyond --max-loras "
                             "(device)."),
}


class LoRACollector(Collector):
    """Per-adapter counters at each scrape (none before the engine loads or without LoRA)."""

    def __init__(self, snapshot: Callable[[], LoRACounts | None]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        counts = self._snapshot()
        if counts is None:
            return
        for name, (label, kinds, doc) in LORA_SERIES.items():
            family = CounterMetricFamily(name, doc, labels=["adapter"] + ([label] if label
                                                                          else []))
            for value, kind in kinds.items():
                for adapter, count in sorted(counts.get(kind, {}).items()):
                    family.add_metric([adapter] + ([value] if label else []), count)
            yield family


def _spec_families(spec: SpecStats) -> Iterable[Metric]:
    """Speculative decoding's counters, labelled by method (and position)."""
    for name, doc, value in (
            ("proposed_tokens", "Guessed tokens verified.", spec.proposed_tokens_total),
            ("accepted_tokens", "Guessed tokens the target model accepted.",
             spec.accepted_tokens_total),
            ("verifications", "Request steps that verified guesses (accepted tokens per "
                              "verification = mean accepted run).", spec.verifications_total)):
        family = CounterMetricFamily(f"baton:spec_decode_{name}", doc, labels=["method"])
        family.add_metric([spec.method], value)
        yield family
    family = CounterMetricFamily("baton:spec_decode_accepted_by_position",
                                 "Guesses accepted at each position of a run (0 = first).",
                                 labels=["method", "position"])
    for position, count in enumerate(spec.accepted_by_position):
        family.add_metric([spec.method, str(position)], count)
    yield family


class RouterMetrics(ConfigMetrics):
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        super().__init__(r)
        self.requests = Counter("baton:router_requests", "Requests answered by the router, by "
                                "status code and tenant.", ["code", "tenant"], registry=r)
        slo = ["model", "decision", "tenant"]  # decision: remote prefill or local
        self.ttft = Histogram("baton:router_time_to_first_token_seconds",
                              "Time from a request's arrival at the router to its first "
                              "output sent to the client (a non-streamed answer: the whole "
                              "answer).", slo, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("baton:router_inter_token_latency_seconds",
                             "Time between consecutive content chunks of a stream, as "
                             "relayed to the client.", slo, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("baton:router_e2e_request_latency_seconds",
                             "Time from a request's arrival at the router to the end of its "
                             "answer.", slo, buckets=E2E_BUCKETS, registry=r)
        self.rate_limited = Counter("baton:router_rate_limited", "Requests refused with 429 "
                                    "by a tenant's rate limit, by tenant and limit.",
                                    ["tenant", "limit"], registry=r)
        self.header_timeouts = Counter(
            "baton:router_header_timeouts", "Connections closed because their request head "
            "(request line + headers) did not arrive within --header-timeout.", registry=r)
        self.kv_releases = Counter(
            "baton:router_kv_releases", "Leases of prefilled KV released on a prefill pod "
            "because no decode pod took them over (the client left), by result.",
            ["result"], registry=r)
        self.upstream_latency = Histogram(
            "baton:router_upstream_latency_seconds",
            "Time from sending a request upstream to its response headers.",
            ["upstream"], buckets=HOP_BUCKETS, registry=r)
        self.upstream_errors = Counter("baton:router_upstream_errors",
                                       "Failed upstream attempts, by upstream and reason.",
                                       ["upstream", "reason"], registry=r)
        self.retries = Counter("baton:router_retries", "Requests retried on another worker.",
                               registry=r)
        self.disagg_decisions = Counter(
            "baton:disagg_decisions", "Routing decisions: remote prefill or local prefill.",
            ["decision"], registry=r)
        self.fallbacks = Counter("baton:fallbacks", "Requests that fell back to local "
                                 "prefill on the decode pod, by reason.", ["reason"],
                                 registry=r)
        self.peer_fetches = Counter(
            "baton:peer_fetches", "Prompt prefixes a decode pod was sent to pull from the "
            "peer holding them (lent), or not (failed: it prefills them).", ["result"],
            registry=r)
        self.upstream_healthy = Gauge("baton:router_upstream_healthy",
                                      "1 when the upstream passes its health checks.",
                                      ["upstream"], registry=r)
        self.registry_connected = Gauge(
            "baton:router_registry_connected", "1 while the router follows the Redis "
            "registry; 0 while it routes from its last view.", registry=r)
