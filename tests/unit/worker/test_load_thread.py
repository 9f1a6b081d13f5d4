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


class _RecordingRegistry:
    """An adapter registry (the calls WorkerLoRA makes) recording the thread of each."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def add(self, name: str, path: str) -> None:
        self.threads.append(threading.current_thread())

    def get(self, name: str):
        self.threads.append(threading.current_thread())
        return "adapter"

    def names(self) -> list[str]:
        return ["ad"]


def test_lora_loads_run_on_threads_that_end_too():
    """A run-time adapter load (and a host copy read again) copies tensors, which may run
    OpenMP regions: on a thread that ends, like the engine's load."""
    from baton.common.lora_protocol import LoadLoRAAdapterRequest
    from baton.worker.lora import WorkerLoRA

    registry = _RecordingRegistry()
    lora = WorkerLoRA(registry, ("base",))  # type: ignore[arg-type]

    async def main() -> list[bool]:
        await lora.load(LoadLoRAAdapterRequest(lora_name="ad", lora_path="/x"))
        assert await lora.adapter_for("ad") == "adapter"
        for thread in registry.threads:
            thread.join(timeout=10)
        return [t.is_alive() for t in registry.threads]

    assert asyncio.run(main()) == [False, False]
    assert threading.main_thread() not in registry.threads
