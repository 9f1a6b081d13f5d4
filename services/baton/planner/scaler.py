"""`baton planner`: every interval, read the live workload, plan, and scale the Deployments.

One tick: `MetricsSource.sample()` -> a `WorkloadEstimate` (rate, and mean lengths when the
page has them) -> `plan()` on the profile -> the wanted replicas of each pool, clamped to its
bounds -> compared with the Deployment's current `spec.replicas`:

- more wanted: scale up at once;
- fewer wanted: scale down only after `scale_down_after` consecutive ticks asked for fewer,
  to the largest count those ticks asked for (a short lull does not drain the pool);
- a Deployment above its max (or below its min) is brought into bounds at once.

No traffic (rate 0) plans the minimum of each pool. When no count within the bounds meets the
SLO, the plan asks for the maximum of both pools (the best the bounds allow) and logs why.
A failed read of the metrics or of the API is logged and the tick is skipped; a failed scale
is retried at the next tick. `dry_run` logs what would change and changes nothing.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

from baton.planner.base import KubeClient, KubeError, MetricsError, MetricsSource, WorkloadEstimate
from baton.planner.plan import PlanError, PlanSettings, plan
from baton.planner.profile import Profile
from baton.planner.simulate import Workload

log = logging.getLogger(__name__)

PlanFn = Callable[[WorkloadEstimate], tuple[int, int]]


@dataclass(frozen=True)
class ScalerConfig:
    namespace: str
    prefill_deployment: str
    decode_deployment: str
    interval_s: float = 30.0
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    scale_down_after: int = 3  # consecutive ticks asking for fewer before scaling down
    dry_run: bool = False

    def __post_init__(self) -> None:
        for name in ("namespace", "prefill_deployment", "decode_deployment"):
            if not getattr(self, name):
                raise ValueError(f"ScalerConfig.{name} must not be empty")
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ValueError(f"ScalerConfig.interval_s={self.interval_s} must be > 0")
        for pool in ("prefill", "decode"):
            low, high = getattr(self, f"min_{pool}"), getattr(self, f"max_{pool}")
            if not 0 <= low <= high or high < 1:
                raise ValueError(f"ScalerConfig.min_{pool}={low} / max_{pool}={high} need "
                                 "0 <= min <= max and max >= 1")
        if self.scale_down_after < 1:
            raise ValueError(f"ScalerConfig.scale_down_after={self.scale_down_after} "
                             "must be >= 1")


@dataclass(frozen=True)
class PoolDecision:
    deployment: str
    current: int
    wanted: int  # the plan's count, clamped to the pool's bounds
    target: int  # what the Deployment is (or, dry-run, would be) scaled to
    action: str  # "up", "down", "hold", "wait" (fewer wanted, hysteresis not over)
    applied: bool  # the Deployment was patched this tick


@dataclass(frozen=True)
class TickReport:
    estimate: WorkloadEstimate | None
    pools: tuple[PoolDecision, ...] = ()
    error: str | None = None  # why the tick did nothing (metrics or API unreachable)


class _Hysteresis:
    """Per pool: scale-down requests seen in a row."""

    def __init__(self, ticks: int) -> None:
        self.ticks = ticks
        self.lower: list[int] = []

    def decide(self, current: int, wanted: int, high: int) -> tuple[int, str]:
        if wanted > current:
            self.lower.clear()
            return wanted, "up"
        if current > high:
            return high, "down"  # out of bounds: no reason to wait
        if wanted == current:
            self.lower.clear()
            return current, "hold"
        self.lower.append(wanted)
        if len(self.lower) < self.ticks:
            return current, "wait"
        return max(self.lower[-self.ticks:]), "down"

    def applied(self) -> None:
        self.lower.clear()


class Scaler:
    """Owns the loop; `tick()` is one interval's work (called from one thread)."""

    def __init__(self, config: ScalerConfig, kube: KubeClient, metrics: MetricsSource,
                 plan_fn: PlanFn) -> None:
        self.config, self.kube, self.metrics, self.plan_fn = config, kube, metrics, plan_fn
        self._pools = {"prefill": _Hysteresis(config.scale_down_after),
                       "decode": _Hysteresis(config.scale_down_after)}

    def run(self, stop: threading.Event | None = None, max_ticks: int | None = None) -> None:
        """Tick every `interval_s` until `stop` is set (or after `max_ticks` ticks)."""
        stop = stop or threading.Event()
        ticks = 0
        while True:
            self.tick()
            ticks += 1
            if (max_ticks is not None and ticks >= max_ticks) or stop.wait(
                    self.config.interval_s):
                return

    def tick(self) -> TickReport:
        try:
            est = self.metrics.sample()
        except MetricsError as err:
            log.warning("metrics unavailable, skipping this interval: %s", err)
            return TickReport(None, error=str(err))
        if est is None:
            log.info("first scrape recorded; planning starts next interval")
            return TickReport(None)
        planned = self.plan_fn(est)
        decisions, errors = [], []
        for pool, want in zip(("prefill", "decode"), planned):
            try:
                decisions.append(self._scale_pool(pool, want))
            except KubeError as err:  # the other pool still gets its turn
                log.warning("%s pool: %s (retrying next interval)", pool, err)
                errors.append(str(err))
        log.info("rate %.3g req/s -> %s", est.rate, ", ".join(
            f"{d.deployment} {d.current}->{d.target} ({d.action})" for d in decisions))
        return TickReport(est, tuple(decisions), error="; ".join(errors) or None)

    def _scale_pool(self, pool: str, planned: int) -> PoolDecision:
        c = self.config
        name = getattr(c, f"{pool}_deployment")
        low, high = getattr(c, f"min_{pool}"), getattr(c, f"max_{pool}")
        wanted = min(max(planned, low), high)
        current = self.kube.get_replicas(c.namespace, name)
        hysteresis = self._pools[pool]
        target, action = hysteresis.decide(current, wanted, high)
        if target == current:
            return PoolDecision(name, current, wanted, target, action, False)
        if c.dry_run:
            log.info("dry-run: would scale %s/%s from %d to %d", c.namespace, name, current,
                     target)
            return PoolDecision(name, current, wanted, target, action, False)
        self.kube.scale(c.namespace, name, target)  # KubeError: the window is kept
        hysteresis.applied()
        log.info("scaled %s/%s from %d to %d", c.namespace, name, current, target)
        return PoolDecision(name, current, wanted, target, action, True)


def profile_plan_fn(profile: Profile, defaults: Workload, settings: PlanSettings,
                    config: ScalerConfig) -> PlanFn:
    """Plan with the measured rate, and the measured mean lengths when the page has them
    (else `defaults`' distributions); each pool's search is bounded by its max."""
    settings = replace(settings, max_prefill=config.max_prefill, max_decode=config.max_decode,
                       max_replicas=config.max_prefill + config.max_decode)

    def plan_for(est: WorkloadEstimate) -> tuple[int, int]:
        if est.rate <= 0:
            return config.min_prefill, config.min_decode
        workload = replace(defaults, rate=est.rate,
                           prompt=_with_mean(defaults.prompt, est.prompt_mean),
                           output=_with_mean(defaults.output, est.output_mean))
        learnt = settings if est.speculation is None else replace(
            settings, speculation=est.speculation)  # the pods' own accepted lengths
        try:
            result = plan(profile, workload, learnt)
        except PlanError as err:
            log.warning("no replica count within the bounds meets the SLO, asking for the "
                        "maximum: %s", err)
            return config.max_prefill, config.max_decode
        return result.prefill, result.decode

    return plan_for


def _with_mean(dist, mean: float | None):
    return dist if mean is None else replace(dist, mean=max(1.0, mean))
