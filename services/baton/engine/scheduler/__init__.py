"""Iteration-level scheduling (Orca) with a token budget, chunked prefill and preemption."""

from baton.engine.scheduler.output import ScheduledRequest, SchedulerOutput
from baton.engine.scheduler.scheduler import Scheduler, make_scheduler
from baton.engine.scheduler.static import StaticScheduler

__all__ = ["Scheduler", "StaticScheduler", "ScheduledRequest", "SchedulerOutput",
           "make_scheduler"]
