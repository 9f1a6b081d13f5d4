"""What the scheduler hands the model runner each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.engine.request import Request


@dataclass
class ScheduledRequest:
    """Run `num_new_tokens` tokens of `request` starting at its `num_computed_tokens`.

    Padding (static batching only) is computed without writing KV or sampling, and stands
    for the waste of a padded static batch: on a finished request, one row re-feeding its last
    token (the slot it keeps until the group ends); on a request whose prompt runs this step,
    `num_new_tokens` pad tokens at positions 0.. (its prompt padded to the group's longest).
    """

    request: Request
    num_new_tokens: int
    is_padding: bool = False

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so a token is sampled."""
        req = self.request
        return (not self.is_padding
                and req.num_computed_tokens + self.num_new_tokens == req.num_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
