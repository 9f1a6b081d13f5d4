"""Iteration-level scheduling (Orca) with a token budget, chunked prefill and preemption."""

from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_connector.base import KVConnector
from baton.engine.scheduler.dynamic import DynamicScheduler
from baton.engine.scheduler.output import ScheduledRequest, SchedulerOutput
from baton.engine.scheduler.scheduler import Scheduler, SchedulerLimits
from baton.engine.scheduler.static import StaticScheduler

__all__ = ["Scheduler", "SchedulerLimits", "StaticScheduler", "DynamicScheduler",
           "ScheduledRequest",
           "SchedulerOutput", "make_scheduler"]


def make_scheduler(limits: SchedulerLimits, kv: KVCacheManager,
                   connector: KVConnector | None = None) -> Scheduler:
    """The scheduler for `limits.policy`; the static and dynamic baselines take no KV
    connector."""
    if limits.policy in ("static", "dynamic"):
        if connector is not None:
            raise ValueError(f"the {limits.policy} scheduling policy is a benchmark baseline "
                             "and does not run disaggregated or with KV tiers (kv_transport "
                             "must be None)")
        return (DynamicScheduler if limits.policy == "dynamic" else StaticScheduler)(limits, kv)
    return Scheduler(limits, kv, connector)
