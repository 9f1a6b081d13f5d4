"""The worker's side of live tuning (`common.tuning`): the file's `worker` section applied to
the engine config at start, and to the running engine on each reload.

Live: `engine.config.LIVE_ARGS`, handed on as a `LiveSettings` — `max_num_seqs` and
`max_num_batched_tokens` (the scheduler's limits; at most the values the worker started
with, since buffers are sized then), `kv_lease_ttl_s`, `kv_transfer_timeout_s`,
`kv_failure_policy`, `speculative_config` (method and k, on or off) — handed to `AsyncEngine.reconfigure`, which applies them on the engine
thread between steps. `restart` knobs (dtype, KV blocks, block size, context length) are
read at start only; a reload that changes one is reported as needing a restart. Fields
pinned by flags are never taken from the file.

`lora_modules` (LoRA adapters, name -> path) join `--lora-modules` at start (a name the
flags give keeps the flags' path); on a reload the adapters the file adds are loaded and the
ones it drops (or moves to another path) unloaded, one reload after another on a thread of
their own — never the event loop's or the engine's; one that fails to load is logged.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from baton.common.metrics import ConfigMetrics
from baton.common.tuning import Tuning, TuningError, set_fields
from baton.engine.config import LIVE_ARGS, EngineConfig, LiveSettings
from baton.engine.lora import LoRAError, UnknownLoRAError
from baton.engine.lora.registry import AdapterRegistry

log = logging.getLogger("baton.config")
RESTART = ("dtype", "num_kv_blocks", "block_size", "max_model_len")


def _wanted(tuning: Tuning, pinned: frozenset[str]) -> dict:
    wanted = set_fields(tuning.worker) | {
        k: v for k, v in tuning.worker.restart.model_dump().items() if v is not None}
    wanted.pop("lora_modules", None)  # joins the flags' adapters (`_with_file_adapters`)
    return {k: v for k, v in wanted.items() if k not in pinned}


def configure(engine: EngineConfig, tuning: Tuning, pinned: frozenset[str]) -> EngineConfig:
    """The engine config to start with: flags' defaults < the file < flags given. Raises
    TuningError naming the field for a value the config refuses."""
    try:
        return _with_file_adapters(engine.with_args(**_wanted(tuning, pinned)),
                                   tuning.worker.lora_modules)
    except ValueError as err:
        raise TuningError(f"worker: {err}") from None


def _with_file_adapters(config: EngineConfig, modules: dict[str, str] | None) -> EngineConfig:
    """`config` serving the file's adapters too (and LoRA on, even for none: `{}`)."""
    if modules is None:
        return config
    given = dict(config.lora.modules)
    return config.with_args(enable_lora=True, lora_modules=given | {
        name: path for name, path in modules.items() if name not in given})


def sync_adapters(registry: AdapterRegistry, drop: list[str],
                  add: list[tuple[str, str]]) -> None:
    """Unload `drop`, then load `add` (name, path); failures are logged, the rest goes on."""
    for name in drop:
        try:
            registry.remove(name)
        except UnknownLoRAError:
            pass  # unloaded meanwhile (POST /v1/unload_lora_adapter)
    for name, path in add:
        try:
            registry.add(name, path)
            log.info("tuning: LoRA adapter %r loaded from %s", name, path)
        except LoRAError as err:
            log.error("tuning: LoRA adapter %r not loaded: %s", name, err)


class WorkerTuner:
    """Applies reloaded tuning files to a running engine (`ConfigWatcher`'s `apply`)."""

    def __init__(self, engine, startup: EngineConfig, pinned: frozenset[str],
                 metrics: ConfigMetrics) -> None:
        """`engine`: the running `AsyncEngine`; `startup`: the config it started with."""
        self.engine = engine
        self.startup = startup
        self.pinned = pinned
        self.metrics = metrics
        self._adapter_loads = ThreadPoolExecutor(1, thread_name_prefix="baton-lora-tuning")

    def apply(self, new: Tuning, old: Tuning | None = None) -> list[str]:
        """Hand `new`'s live knobs to the engine and start loading / unloading the LoRA
        adapters it adds / drops against `old`; return the restart knobs it changes.
        Raises TuningError (nothing changed) for a limit above the start value, an invalid
        value, or adapters for a worker started without LoRA."""
        want = _wanted(new, self.pinned)
        live = self._live_settings(want)
        try:
            self.startup.check_live(live)
        except ValueError as err:
            raise TuningError(f"worker.{err}") from None
        adapters = self._adapter_changes(new, old)
        self.engine.reconfigure(live)
        if adapters is not None:
            self._adapter_loads.submit(sync_adapters, *adapters)
        restart = sorted(k for k in RESTART if k in want and want[k] != self.startup.arg(k))
        self.metrics.config_restart_pending.set(1 if restart else 0)
        return restart

    def _adapter_changes(self, new: Tuning, old: Tuning | None
                         ) -> tuple[AdapterRegistry, list[str], list[tuple[str, str]]] | None:
        """(registry, names to unload, (name, path) to load) between the files' adapters,
        None when they are the same."""
        want = new.worker.lora_modules or {}
        had = (old.worker.lora_modules if old is not None else None) or {}
        if want == had:
            return None
        registry = self.engine.lora_registry
        if registry is None:
            raise TuningError("worker.lora_modules: this worker started without LoRA "
                              "adapters; restart it with --enable-lora (or lora_modules in "
                              "this file)")
        return (registry, [n for n, p in had.items() if want.get(n) != p],
                [(n, p) for n, p in want.items() if had.get(n) != p])

    def _live_settings(self, want: dict) -> LiveSettings:
        try:
            live = {k: want[k] for k in LIVE_ARGS if k in want}
            return self.startup.with_args(**live).live_settings
        except ValueError as err:
            raise TuningError(f"worker: {err}") from None
