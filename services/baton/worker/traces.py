"""A worker's spans for one request (`common.tracing`; nothing is recorded when it is off).

    worker.<api> (server, the caller's traceparent)     arrival -> the answer's last byte
      worker.queue                                       arrival -> first scheduled
      worker.kv_transfer                                 the KV pull (decode role)
      event first_token                                  when each job's first token came
      worker.prefill                                     the whole prefill (prefill role)

The engine reports queue and transfer times as durations, so the child spans are recorded
after the fact from the jobs' timestamps, not timed around engine calls.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from baton.common.tracing import Span, Tracing
from baton.worker.serving import Job


def start_request(tracing: Tracing, name: str, headers: Mapping[str, str],
                  **attributes: str | int | float | bool) -> Span:
    """The request's span, a child of the caller's `traceparent` (a router's, or a
    client's own) when it sends one."""
    return tracing.start(name, headers=headers, attributes=attributes)


def end_request(tracing: Tracing, span: Span, jobs: list[Job],
                error: BaseException | None = None) -> None:
    """Record the jobs' queue / transfer spans and first tokens under `span`, then end it
    (with an error status for `error`)."""
    if not tracing.enabled:
        return
    to_wall = time.time_ns() - time.monotonic_ns()  # monotonic ns -> epoch ns
    for job in jobs:
        if not job.arrival:
            continue
        arrival = int(job.arrival * 1e9) + to_wall
        if job.queue_s is not None:
            _after_the_fact(tracing, span, "worker.queue", arrival, job.queue_s)
        if job.kv_transfer_s is not None:
            _after_the_fact(tracing, span, "worker.kv_transfer",
                            arrival + int((job.queue_s or 0) * 1e9), job.kv_transfer_s)
        if job.first_token is not None:
            span.event("first_token", {"baton.choice": job.index,
                                       "baton.worker_ttft_s": job.first_token.worker_s})
    if error is not None:
        span.error(f"{type(error).__name__}: {error}")
    span.end()


def _after_the_fact(tracing: Tracing, parent: Span, name: str, start_ns: int,
                    seconds: float) -> None:
    tracing.start(name, parent=parent, start_ns=start_ns).end(start_ns + int(seconds * 1e9))
