"""Async scheduling: step N+1 is scheduled and launched before step N's tokens are read, so
the host's work between steps (scheduling, reading tokens back, stop checks, detokenising,
outputs) overlaps the device's step instead of leaving it idle (vLLM's async scheduling,
SGLang's overlap scheduler).

When a step is launched its requests' counters advance as if it had run, and each row that
samples adds a pending token (`Request.add_pending`); the scheduler schedules the next step
over those counters, the pending token as a decode's input. Reading the step's results
fills the pending tokens in (`Scheduler.resolve_pending`) and ends requests as a
synchronous step would; a request that ended there had one more step launched, whose token
is dropped. A runner that launches asynchronously (`launches_async`: the simulated device;
ModelRunner on CUDA, which takes the inputs from the previous step's token tensor on the
device, `runner/ahead.py`) never needs a pending token's id on the host; a synchronous
runner (ModelRunner on CPU) has run the step by the time it returns, so the engine writes
its tokens in before launching the next (`fill_inputs`), and the outputs are the same
either way. `auto` turns it on where the runner says so (`async_by_default`: the simulated
device; ModelRunner on CUDA with one rank, measured on an H200 at +14-42% decode throughput;
not yet under tensor parallelism, unmeasured on GPUs).

A request whose next step needs its last token on the host — a structured output's grammar
masks the next token's logits by it; a prefill whose KV a puller takes once its token is
known — makes its step a synchronous one (`Launched.sync`): the engine reads it at once.
Penalties need no such read: a penalised request's pending token is read on the device
too (`penalty_ids`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from baton.engine.config import EngineConfig, LiveSettings, SchedulingPolicy
from baton.engine.kv_connector.handoff import HoldKV
from baton.engine.request import Request
from baton.engine.runner.step_result import StepResult
from baton.engine.scheduler.output import SchedulerOutput


class StepHandle(Protocol):
    def result(self) -> StepResult:
        """The step's results, waiting for its end."""
        ...


@dataclass
class Launched:
    """A step launched and not read yet."""

    sched: SchedulerOutput
    handle: StepHandle
    sampling: list[Request]  # the requests it samples a token for, each pending
    sync: bool  # their next step needs its tokens on the host: read it at once


def async_scheduling(config: EngineConfig, runner) -> bool:
    """Whether the engine schedules ahead: `async_scheduling` as configured, or (None) when
    the runner launches asynchronously. Raises ValueError when it is asked for with a mode
    that needs each step's tokens before the next is scheduled."""
    scheduler = config.scheduler
    why = None
    if scheduler.speculative.method is not None:
        why = "speculative decoding (the guesses come from the last token)"
    elif scheduler.policy in (SchedulingPolicy.STATIC, SchedulingPolicy.DYNAMIC):
        why = f"the {scheduler.policy.value} policy (it runs groups to completion)"
    if scheduler.async_scheduling and why is not None:
        raise ValueError(f"async_scheduling does not combine with {why}")
    if why is not None or scheduler.async_scheduling is False:
        return False
    return bool(scheduler.async_scheduling or runner.async_by_default)


def check_live(scheduling_async: bool, live: LiveSettings) -> None:
    """Live tuning cannot turn speculative decoding on in an engine scheduling ahead."""
    if scheduling_async and live.scheduler.speculative.method is not None:
        raise ValueError("speculative decoding needs each step's tokens before the next: "
                         "this engine schedules asynchronously")


def launched(sched: SchedulerOutput, handle: StepHandle) -> Launched:
    """A step just launched: its requests' counters advance as if it had run, a pending
    token for each that samples (a row's `samples` is read now: it counts from them)."""
    sampling = [s.request for s in sched.scheduled if s.samples]
    for s in sched.scheduled:
        s.request.num_computed_tokens += s.num_new_tokens
    sync = False
    for req in sampling:
        req.add_pending()
        sync = sync or req.grammar is not None or isinstance(req.kv_handoff, HoldKV)
    return Launched(sched, handle, sampling, sync)


def fill_inputs(prev: Launched) -> None:
    """A synchronous runner reads the next step's input ids on the host: write the tokens
    `prev` sampled into its requests' pending places (each holds one, `prev`'s; they stay
    pending until `prev` is read)."""
    sampled = prev.handle.result().sampled
    for req in prev.sampling:
        tokens = sampled.get(req.request_id)
        if req.num_pending and tokens:
            req.output_token_ids[len(req.output_token_ids) - req.num_pending] = tokens[0]
