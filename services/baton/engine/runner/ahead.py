"""A model step launched ahead of the host (async scheduling, `engine/step_pipeline.py`).

`ModelRunner` splits a step in two: launching it (batch, forward, logits, the sampler's
device part) and reading its tokens back (`StepInFlight.result`). Read back at once, that
is the synchronous step. Launched ahead on CUDA (`ModelRunner.launches_async`), nothing in
the launch waits on the device: the sampled tokens (and logprob tables) are copied to the
host by a non-blocking copy queued right after the step, with an event; `result` waits on
that event only — not on the step launched after it — and the next step takes its pending
inputs from this step's token tensor on the device (`fill_pending`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from baton.engine.distributed import TPGroup
from baton.engine.penalty_ids import PendingTokens
from baton.engine.request import Request
from baton.engine.runner.batch import FlatBatch
from baton.engine.runner.step_result import StepResult
from baton.engine.sample_readback import Staged, read_staged
from baton.engine.scheduler.output import ScheduledRequest
from baton.engine.spec.rejection import RejectionSampler
from baton.engine.spec.verify import verify
from baton.engine.structured.masks import GrammarMasks


class LaunchedRow(ScheduledRequest):
    """A sampling row as it was launched: the engine advances its request's counters at
    launch, which would change what `samples` / `num_sampled` compute by the time the
    step is read."""

    def __init__(self, row: ScheduledRequest) -> None:
        super().__init__(row.request, row.num_new_tokens, row.spec_token_ids)
        self._num_sampled = row.num_sampled

    @property
    def samples(self) -> bool:
        return self._num_sampled > 0

    @property
    def num_sampled(self) -> int:
        return self._num_sampled


@dataclass
class StepInFlight:
    """A launched step: what turns its sampled rows into each request's tokens once read.
    `tokens` / `token_index`: its sampled tokens on the device and each sampled request's
    row there, for the next step's pending inputs."""

    entries: list[ScheduledRequest]
    logits: torch.Tensor | None
    staged: Staged | None
    failed: dict[str, str]
    masks: GrammarMasks | None
    prompt_logprobs: dict
    rejection: RejectionSampler | None
    token_index: dict[str, int] = field(default_factory=dict)
    timed: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # CUDA: around the step
    on_timed: Callable[[float], None] | None = None  # hears the step's device seconds
    on_read: Callable[[], None] | None = None  # called once its tokens are read
    _result: StepResult | None = None

    @property
    def tokens(self) -> torch.Tensor | None:
        return None if self.staged is None else self.staged.sample.tokens

    def result(self) -> StepResult:
        """The step's `StepResult` (waiting for its tokens the first time)."""
        if self._result is None:
            try:
                tokens, lps = read_staged(self.staged) if self.staged is not None else ([], [])
            finally:  # read or failed, it is no longer in flight
                if self.on_read is not None:
                    self.on_read()
                    self.on_read = None
            if self.timed is not None and self.on_timed is not None:
                self.timed[1].synchronize()
                self.on_timed(self.timed[0].elapsed_time(self.timed[1]) / 1000)
            if not self.entries:
                self._result = StepResult({}, {}, {}, self.prompt_logprobs)
            else:
                assert self.logits is not None and self.rejection is not None
                out = verify(self.entries, self.logits, tokens, lps, self.failed,
                             self.rejection, self.masks)
                self._result = StepResult(out.sampled, out.logprobs, self.failed,
                                          self.prompt_logprobs, out.guessed)
            self.logits = self.masks = None  # (N, V): not held while the next step runs
        return self._result

def sampled_index(reqs: list[Request]) -> dict[str, int]:
    """Each sampled request's row in the step's sampled tokens (one row each: async
    scheduling runs without speculation)."""
    return {r.request_id: i for i, r in enumerate(reqs)}


def fill_pending(batch: FlatBatch, prev: StepInFlight | None, group: TPGroup) -> None:
    """Write the previous step's sampled tokens into this batch's pending input rows, on the
    device (no host read). Under tensor parallelism rank 0 (the one that samples) also
    broadcasts them to the followers, which fill the same rows (`fill_follower_pending`);
    it has sent them the step first, so each is waiting for them."""
    if batch.pending_rows is None or batch.pending_src is None:
        return
    if prev is None or prev.tokens is None:
        raise RuntimeError("a pending input with no step launched before it to take it from")
    tokens = group.broadcast(prev.tokens.index_select(0, batch.pending_src))
    batch.input_ids.index_copy_(0, batch.pending_rows, tokens)


def fill_follower_pending(batch: FlatBatch, group: TPGroup) -> None:
    """A follower's side of `fill_pending`: its pending rows take the tokens rank 0
    broadcasts."""
    if batch.pending_rows is None:
        return
    tokens = torch.empty(batch.pending_rows.shape[0], dtype=torch.int64,
                         device=batch.input_ids.device)
    batch.input_ids.index_copy_(0, batch.pending_rows, group.broadcast(tokens))


def pending_tokens(prev: StepInFlight | None) -> PendingTokens | None:
    """Where the next step's sampler reads its penalised requests' pending tokens: `prev`'s
    sampled tokens on the device (None when no step is in flight)."""
    if prev is None or prev.tokens is None:
        return None
    return PendingTokens(prev.tokens, prev.token_index)
