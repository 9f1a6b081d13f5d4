"""The worker's side of live tuning (`common.tuning`): the file's `worker` section applied to
the engine config at start, and to the running engine on each reload.

Live: `max_num_seqs` and `max_num_batched_tokens` (the scheduler's limits; at most the values
the worker started with, since buffers are sized then), `kv_lease_ttl_s`,
`kv_transfer_timeout_s`, `kv_failure_policy`. Changes are made on the engine thread between
steps. `restart` knobs (dtype, KV blocks, block size, context length) are read at start
only; a reload that changes one is reported as needing a restart.
"""

from __future__ import annotations

from dataclasses import replace

from baton.common.metrics import ConfigMetrics
from baton.common.tuning import Tuning, TuningError, set_fields
from baton.engine.config import EngineConfig

# The worker's tuning fields that EngineConfig has under the same name.
LIVE = ("max_num_seqs", "max_num_batched_tokens", "kv_lease_ttl_s", "kv_transfer_timeout_s",
        "kv_failure_policy")
RESTART = ("dtype", "num_kv_blocks", "block_size", "max_model_len")


def _wanted(tuning: Tuning, pinned: frozenset[str]) -> dict:
    fields = set_fields(tuning.worker) | {
        k: v for k, v in tuning.worker.restart.model_dump().items() if v is not None}
    return {k: v for k, v in fields.items() if k not in pinned}


def configure(engine: EngineConfig, tuning: Tuning, pinned: frozenset[str]) -> EngineConfig:
    """The engine config to start with: flags' defaults < the file < flags given."""
    try:
        return replace(engine, **_wanted(tuning, pinned))
    except ValueError as err:
        raise TuningError(f"worker: {err}") from None


class WorkerTuner:
    def __init__(self, state, startup: EngineConfig, pinned: frozenset[str],
                 metrics: ConfigMetrics) -> None:
        self.state = state
        self.startup = startup
        self.pinned = pinned
        self.metrics = metrics

    def apply(self, new: Tuning, _old: Tuning | None = None) -> list[str]:
        cfg = self.startup
        want = _wanted(new, self.pinned)
        live = {k: want.get(k, getattr(cfg, k)) for k in LIVE}
        for k in ("max_num_seqs", "max_num_batched_tokens"):
            if live[k] > getattr(cfg, k):
                raise TuningError(f"worker.{k}={live[k]} is above the {getattr(cfg, k)} this "
                                  "worker started with; raising it needs a restart")
        engine = self.state.engine
        if engine is None:
            raise TuningError("the engine is still loading")
        core = engine.core

        def on_engine_thread() -> None:
            sched = core.scheduler
            sched.limits = replace(sched.limits, max_num_seqs=live["max_num_seqs"],
                                   max_num_batched_tokens=live["max_num_batched_tokens"])
            if core.kvx is not None:
                core.kvx.lease_ttl_s = live["kv_lease_ttl_s"]
                core.kvx.timeout_s = live["kv_transfer_timeout_s"]
                core.kvx.failure_policy = live["kv_failure_policy"]

        engine.call_soon(on_engine_thread)
        restart = sorted(k for k in RESTART if k in want and want[k] != getattr(cfg, k))
        self.metrics.config_restart_pending.set(1 if restart else 0)
        return restart
