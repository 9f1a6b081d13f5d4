"""The worker's side of live tuning (`common.tuning`): the file's `worker` section applied to
the engine config at start, and to the running engine on each reload.

Live: `engine.config.LIVE_ARGS`, handed on as a `LiveSettings` — `max_num_seqs` and
`max_num_batched_tokens` (the scheduler's limits; at most the values the worker started
with, since buffers are sized then), `kv_lease_ttl_s`, `kv_transfer_timeout_s`,
`kv_failure_policy`, `speculative_config` (method and k, on or off) — handed to `AsyncEngine.reconfigure`, which applies them on the engine
thread between steps. `restart` knobs (dtype, KV blocks, block size, context length) are
read at start only; a reload that changes one is reported as needing a restart. Fields
pinned by flags are never taken from the file.
"""

from __future__ import annotations

from baton.common.metrics import ConfigMetrics
from baton.common.tuning import Tuning, TuningError, set_fields
from baton.engine.config import LIVE_ARGS, EngineConfig, LiveSettings

RESTART = ("dtype", "num_kv_blocks", "block_size", "max_model_len")


def _wanted(tuning: Tuning, pinned: frozenset[str]) -> dict:
    wanted = set_fields(tuning.worker) | {
        k: v for k, v in tuning.worker.restart.model_dump().items() if v is not None}
    return {k: v for k, v in wanted.items() if k not in pinned}


def configure(engine: EngineConfig, tuning: Tuning, pinned: frozenset[str]) -> EngineConfig:
    """The engine config to start with: flags' defaults < the file < flags given. Raises
    TuningError naming the field for a value the config refuses."""
    try:
        return engine.with_args(**_wanted(tuning, pinned))
    except ValueError as err:
        raise TuningError(f"worker: {err}") from None


class WorkerTuner:
    """Applies reloaded tuning files to a running engine (`ConfigWatcher`'s `apply`)."""

    def __init__(self, engine, startup: EngineConfig, pinned: frozenset[str],
                 metrics: ConfigMetrics) -> None:
        """`engine`: the running `AsyncEngine`; `startup`: the config it started with."""
        self.engine = engine
        self.startup = startup
        self.pinned = pinned
        self.metrics = metrics

    def apply(self, new: Tuning, _old: Tuning | None = None) -> list[str]:
        """Hand `new`'s live knobs to the engine; return the restart knobs it changes.
        Raises TuningError (nothing changed) for a limit above the start value or an
        invalid value."""
        want = _wanted(new, self.pinned)
        live = self._live_settings(want)
        try:
            self.startup.check_live(live)
        except ValueError as err:
            raise TuningError(f"worker.{err}") from None
        self.engine.reconfigure(live)
        restart = sorted(k for k in RESTART if k in want and want[k] != self.startup.arg(k))
        self.metrics.config_restart_pending.set(1 if restart else 0)
        return restart

    def _live_settings(self, want: dict) -> LiveSettings:
        try:
            live = {k: want[k] for k in LIVE_ARGS if k in want}
            return self.startup.with_args(**live).live_settings
        except ValueError as err:
            raise TuningError(f"worker: {err}") from None
