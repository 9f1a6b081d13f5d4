"""What the scheduler hands the model runner each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """Run `num_new_tokens` tokens of `request` starting at its `num_computed_tokens`,
    writing their KV; sample a token when they reach the end of its known tokens.
    `spec_token_ids`: guesses run after its last known token (the tail of the
    `num_new_tokens`); each of their rows samples too, to verify them (`engine.spec`).

    A policy may schedule rows of another kind (the static baseline's padding) by
    subclassing: the batch builder only asks `start`, `input_ids`, `writes_kv`, `samples`,
    `num_sampled`.
    """

    request: Request
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)
    writes_kv = True  # class-level: a subclass may compute rows whose KV is thrown away

    @property
    def start(self) -> int:
        """The position of the first token this row feeds."""
        return self.request.num_computed_tokens

    def input_ids(self, start: int, end: int) -> list[int]:
        """Its token ids at positions [start, end): known tokens, then guesses."""
        if not self.spec_token_ids:  # a row without guesses feeds known tokens only
            return self.request.token_ids(start, end)
        known = self.request.num_tokens
        ids = self.request.token_ids(start, min(end, known)) if start < known else []
        if end > known:
            ids = ids + self.spec_token_ids[max(start, known) - known:end - known]
        return ids

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens, so a token is sampled."""
        req = self.request
        return (req.num_computed_tokens + self.num_new_tokens
                == req.num_tokens + len(self.spec_token_ids))

    @property
    def num_sampled(self) -> int:
        """Rows that sample: the last known token's and one per guess (0: none)."""
        return 1 + len(self.spec_token_ids) if self.samples else 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Rows computed and thrown away (only the static baseline's padding): they run in the
    # batch but write no KV, sample nothing and advance no request.
    padding: list[ScheduledRequest] = field(default_factory=list)

    @property
    def rows(self) -> list[ScheduledRequest]:
        """Everything the model runs this step."""
        return self.scheduled + self.padding if self.padding else self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.rows)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.padding


@dataclass(frozen=True)
class EngineEnd:
    """An end the engine decides from a sampled token before the scheduler sees it: a stop
    string matched in its text or a structured output completed (FINISHED_STOPPED), or the
    request's own sampling or detokenising failing (FINISHED_ERROR). The scheduler applies
    it with its own stop checks (`Scheduler.update_from_output`), so a request ends once,
    with its final status, before the KV connector hears of it."""

    status: RequestStatus
    reason: str | None = None  # the stop string matched, or the error
    # with several tokens in a step (speculation): the index of the token it ends at (the
    # later ones are dropped); None: after the last
    at: int | None = None
