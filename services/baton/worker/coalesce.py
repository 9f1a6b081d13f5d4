"""`--stream-interval N` (vLLM's): a stream's tokens leave in SSE chunks of at least N
tokens — the first and the last at once — so the front's work per token (one event, one
socket write per chunk) falls N-fold under load, for chunkier inter-token gaps. Tokens that
arrived together while a stream was behind leave together anyway (`AsyncEngine.stream`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from baton.engine.outputs import EngineOutput
from baton.worker.serving import Update


def coalesced(updates: AsyncIterator[Update], interval: int) -> AsyncIterator[Update]:
    """`updates`, each choice's held back until it carries `interval` tokens, its first
    (the time to first token) and its last (the finish) at once; `updates` itself (no
    layer in between) when `interval` is 1."""
    return updates if interval <= 1 else _held(updates, interval)


async def _held(updates: AsyncIterator[Update], interval: int) -> AsyncIterator[Update]:
    held: dict[int, list[EngineOutput]] = {}  # by choice: outputs not sent yet
    started: set[int] = set()  # choices whose first update has gone
    async for job, batch in updates:
        batch = held.pop(job.index, []) + batch
        if (job.index in started and not batch[-1].finished
                and sum(len(o.new_token_ids) for o in batch) < interval):
            held[job.index] = batch
            continue
        started.add(job.index)
        yield job, batch
