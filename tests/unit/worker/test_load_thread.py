"""The worker loads its engine on a thread that ends after the load: a thread that ran
OpenMP parallel regions keeps its libgomp worker pool while it lives, and a pool left beside
the engine thread's made every barrier of a decode step sleep on a futex (`baton serve
--num-threads 2` on 2 cores: 2.3x slower at batch 1; see `app.on_a_thread_that_ends`)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from baton.worker.app import _load, on_a_thread_that_ends
from baton.worker.state import WorkerSettings, WorkerState
from tests.unit.worker.fakes import FakeEngine


def test_the_engine_loads_on_a_thread_that_ends_with_the_load():
    state = WorkerState(WorkerSettings())
    loaded_on: list[threading.Thread] = []

    def load() -> None:
        loaded_on.append(threading.current_thread())
        state.engine = FakeEngine()

    state.load = load  # type: ignore[method-assign]

    async def main() -> bool:
        await _load(state)
        # the event loop is still running: a shared executor's thread would still be alive
        loaded_on[0].join(timeout=10)
        return loaded_on[0].is_alive()

    still_alive = asyncio.run(main())
    assert state.engine is not None and state.load_error is None
    assert loaded_on[0] is not threading.main_thread()
    assert not still_alive


def test_a_load_failure_reaches_the_caller_from_its_thread():
    def fail() -> None:
        raise RuntimeError("no such model")

    with pytest.raises(RuntimeError, match="no such model"):
        asyncio.run(on_a_thread_that_ends(fail))
