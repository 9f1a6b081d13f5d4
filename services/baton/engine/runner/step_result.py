"""What a model step gives the engine (`StepResult`), and a step already run
(`FinishedStep`: what a synchronous runner's `launch` answers)."""

from __future__ import annotations

from typing import NamedTuple

from baton.engine.logprobs import TokenLogprobs


class StepResult(NamedTuple):
    """One step's output: the tokens each request gained (one, or with speculation its
    accepted guesses and then the target's own token) and their logprobs, by request id;
    `failed` maps the requests whose own sampling settings raised (sampled nothing) to the
    error; `prompt_logprobs` the next prompt tokens' logprobs of requests asking for them
    (None for tokens a prefix-cache hit skipped), to append to `Request.prompt_logprobs`;
    `guessed` the (guesses, accepted) counts of the requests that verified guesses."""

    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]]
    failed: dict[str, str]
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
    guessed: dict[str, tuple[int, int]] = {}


class FinishedStep(NamedTuple):
    """A step a synchronous runner has run already (`launch`'s answer): reading it never
    waits."""

    step: StepResult

    def result(self) -> StepResult:
        return self.step
