"""Dynamic batching, the textbook's middle policy, kept as a benchmark baseline beside
`static` and continuous `fcfs`: requests are collected until `max_num_seqs` of them wait or
the oldest has waited `batch_window_s`, then run as one static group (padded, to completion,
nobody joining: `StaticScheduler`). While collecting, `schedule()` returns an empty step and
`idle_for()` tells the engine how long it may sleep."""

from __future__ import annotations

import time

from baton.engine.scheduler.output import SchedulerOutput
from baton.engine.scheduler.static import StaticScheduler


class DynamicScheduler(StaticScheduler):
    def idle_for(self) -> float:
        if self.running or not self.waiting:
            return 0.0
        if len(self.waiting) >= self.limits.max_num_seqs:
            return 0.0
        oldest = self.waiting.peek().arrival_time  # FCFS: the head arrived first
        return max(0.0, oldest + self.limits.batch_window_s - time.monotonic())

    def schedule(self) -> SchedulerOutput:
        if not self.running and self.idle_for() > 0:
            return SchedulerOutput()  # still collecting the next group
        return super().schedule()
