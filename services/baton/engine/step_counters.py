"""What the engine counts as it steps (the rest of `EngineStats` is read live)."""

from __future__ import annotations

from dataclasses import dataclass

from baton.engine.scheduler.output import SchedulerOutput


@dataclass
class StepCounters:
    """What the engine counts as it steps (the rest of `EngineStats` is read live)."""
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    preemptions_total: int = 0
    steps_total: int = 0
    step_tokens_total: int = 0  # tokens the steps computed, padding included
    padded_tokens_total: int = 0  # of which padding (the static and dynamic baselines')

    def count(self, sched: SchedulerOutput) -> None:
        """A step was scheduled (and launched)."""
        self.steps_total += 1
        self.step_tokens_total += sched.num_tokens
        self.padded_tokens_total += sum(p.num_new_tokens for p in sched.padding)
        self.prompt_tokens_total += sum(
            s.num_new_tokens for s in sched.scheduled
            if s.request.num_computed_tokens < s.request.num_prompt_tokens)
