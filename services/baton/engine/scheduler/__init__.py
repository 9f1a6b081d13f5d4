"""Iteration-level scheduling (Orca) with a token budget, chunked prefill and preemption."""

from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_connector.base import KVConnector
from baton.engine.scheduler.output import ScheduledRequest, SchedulerOutput
from baton.engine.scheduler.scheduler import Scheduler, SchedulerLimits
from baton.engine.scheduler.static import StaticScheduler

__all__ = ["Scheduler", "SchedulerLimits", "StaticScheduler", "ScheduledRequest",
           "SchedulerOutput", "make_scheduler"]


def make_scheduler(limits: SchedulerLimits, kv: KVCacheManager,
                   connector: KVConnector | None = None) -> Scheduler:
    """The scheduler for `limits.policy`; the static baseline takes no KV connector."""
    if limits.policy == "static":
        if connector is not None:
            raise ValueError("the static scheduling policy is a benchmark baseline and "
                             "does not run disaggregated (kv_transport must be None)")
        return StaticScheduler(limits, kv)
    return Scheduler(limits, kv, connector)
