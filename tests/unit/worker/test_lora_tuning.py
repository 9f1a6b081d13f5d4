"""LoRA adapters from the live-tuning file: at start they join `--lora-modules` (the flags
win a name), and on each reload the adapters the file adds load and the ones it drops or
moves unload — on a thread of their own; a worker without LoRA refuses the reload."""

from __future__ import annotations

import time

import pytest

from baton.common.metrics import WorkerMetrics
from baton.common.tuning import TuningError, parse_tuning
from baton.engine.config import EngineConfig
from baton.engine.lora import LoRAError
from baton.engine.lora.adapter import LoRAAdapter
from baton.engine.lora.registry import AdapterRegistry
from baton.engine.lora.stats import LoRACounters
from baton.worker.tuning import WorkerTuner, configure


def build(name: str, path: str, load_id: int) -> LoRAAdapter:
    """A host copy without weights (what the registry keeps is all these tests look at)."""
    if "missing" in path:
        raise LoRAError(f"LoRA adapter {name!r}: {path} has no adapter_config.json")
    return LoRAAdapter(name, path, load_id, digest=path, rank=4, weights={})


class LoRAEngine:
    def __init__(self, registry: AdapterRegistry | None) -> None:
        self.lora_registry, self.applied = registry, []

    def reconfigure(self, live) -> None:
        self.applied.append(live)


def served(registry: AdapterRegistry, want: dict[str, str]) -> None:
    deadline = time.monotonic() + 5
    while registry.paths() != want:
        assert time.monotonic() < deadline, registry.paths()
        time.sleep(0.01)


def test_the_files_adapters_join_the_flags_at_start():
    flags = EngineConfig.from_args(lora_modules=["sql=/flags/sql"])
    file = parse_tuning("worker: {lora_modules: {sql: /file/sql, chat: /file/chat}}")
    config = configure(flags, file, frozenset({"lora_modules"}))
    assert dict(config.lora.modules) == {"sql": "/flags/sql", "chat": "/file/chat"}
    assert configure(EngineConfig(), parse_tuning("worker: {lora_modules: {}}"),
                     frozenset()).lora.enabled  # on, with no adapter yet


def test_reloads_load_and_unload_the_adapters_they_change(caplog):
    registry = AdapterRegistry(build, 8, LoRACounters())
    registry.add("static", "/flags/static")  # from --lora-modules: the file leaves it be
    engine = LoRAEngine(registry)
    tuner = WorkerTuner(engine, EngineConfig(), frozenset(), WorkerMetrics())
    first = parse_tuning("worker: {lora_modules: {a: /p/a, b: /p/b}}")
    tuner.apply(first)
    served(registry, {"static": "/flags/static", "a": "/p/a", "b": "/p/b"})
    second = parse_tuning("worker: {lora_modules: {b: /q/b, c: /p/c, d: /missing/d}}")
    tuner.apply(second, first)
    served(registry, {"static": "/flags/static", "b": "/q/b", "c": "/p/c"})
    deadline = time.monotonic() + 5
    while "'d' not loaded" not in caplog.text:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    tuner.apply(parse_tuning("worker: {}"), second)
    served(registry, {"static": "/flags/static"})
    assert len(engine.applied) == 3  # the other live knobs still applied each time


def test_a_worker_without_lora_refuses_adapters_in_a_reload():
    engine = LoRAEngine(None)
    tuner = WorkerTuner(engine, EngineConfig(), frozenset(), WorkerMetrics())
    with pytest.raises(TuningError, match="started without LoRA"):
        tuner.apply(parse_tuning("worker: {lora_modules: {a: /p/a}}"))
    assert engine.applied == []
