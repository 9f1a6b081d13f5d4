"""How busy an engine keeps its device: per step, the device's seconds (modelled on the
simulated device; the model step's own time elsewhere: on CPU the forward and sampling,
which occupy the cores; on CUDA the time the host waited on the step) and the rest of the
step's wall time, the host's — scheduling, stop checks, detokenising, building the batch —
during which a synchronous engine leaves the device idle.

Exported on `/metrics` as `baton:engine_device_busy_seconds_total`,
`baton:engine_step_seconds_total` (their rates' ratio is the device-busy fraction) and the
histogram `baton:engine_step_host_seconds`."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

# upper bounds of the host-seconds histogram's buckets (a GPU decode step is 5-20 ms)
HOST_BUCKETS_S = (25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3,
                  50e-3, 0.1, 0.25)


@dataclass
class StepTiming:
    steps: int = 0
    device_s: float = 0.0
    wall_s: float = 0.0
    host_s: float = 0.0
    host_counts: list[int] = field(default_factory=lambda: [0] * (len(HOST_BUCKETS_S) + 1))

    def record(self, wall_s: float, device_s: float) -> None:
        """One step took `wall_s`, of which the device was busy `device_s`."""
        host = max(0.0, wall_s - device_s)
        self.steps += 1
        self.wall_s += wall_s
        self.device_s += device_s
        self.host_s += host
        self.host_counts[bisect.bisect_left(HOST_BUCKETS_S, host)] += 1

    def snapshot(self) -> StepTiming:
        return replace(self, host_counts=list(self.host_counts))

    @property
    def busy_fraction(self) -> float:
        return self.device_s / self.wall_s if self.wall_s else 0.0

    def families(self) -> Iterable[Metric]:
        yield CounterMetricFamily("baton:engine_device_busy_seconds",
                                  "Seconds the engine's device was busy with model steps "
                                  "(modelled on --device sim).", value=self.device_s)
        yield CounterMetricFamily("baton:engine_step_seconds",
                                  "Wall seconds of engine steps (busy / this = the device-busy "
                                  "fraction while stepping).", value=self.wall_s)
        buckets, total = [], 0
        for bound, count in zip((*map(str, HOST_BUCKETS_S), "+Inf"), self.host_counts):
            total += count
            buckets.append((bound, total))
        yield HistogramMetricFamily("baton:engine_step_host_seconds",
                                    "Host seconds per engine step (the step's wall time less "
                                    "the device's).", buckets=buckets, sum_value=self.host_s)
