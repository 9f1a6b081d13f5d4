"""A worker's settings (from `baton serve`'s flags) and its state while it runs."""

from __future__ import annotations

import gc
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from baton.common.errors import OpenAIError
from baton.common.metrics import LoRACounts, WorkerMetrics
from baton.common.registry import LoadReport, hash_hex
from baton.common.roles import ROLE_NAMES, Role
from baton.common.stats import EngineStats
from baton.common.tracing import setup_tracing
from baton.engine.config import ENGINE_PROCESS_MODES, EngineConfig, EngineProcess
from baton.engine.models.hub import SCHEME, HubRef, is_repo_id
from baton.worker.lora import WorkerLoRA
from baton.worker.openai_api import OpenAIFormat
from baton.worker.pipeline import Pipeline
from baton.worker.reasoning import REASONING_PARSER_CHOICES
from baton.worker.serving import Serving
from baton.worker.tool_parsers import PARSER_CHOICES

if TYPE_CHECKING:
    from baton.common.tuning import ConfigWatcher
    from baton.engine.async_engine import AsyncEngine
    from baton.worker.registration import Registration


@dataclass(frozen=True)
class WorkerSettings:
    """`role`: see `common.roles.Role` (a role name is taken too). `max_waiting` bounds
    requests not yet scheduled; beyond it, 429. Raises ValueError naming the field."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    role: Role = Role.BOTH
    # The name(s) requests may use (`--served-model-name a b`), the first the one reported
    # in responses (vLLM's); None: the --model argument's name.
    served_model_name: str | tuple[str, ...] | None = None
    max_waiting: int = 256
    pinned: frozenset[str] = frozenset()  # tuning fields set by flags: the file keeps off
    registry_url: str | None = None  # redis://…: register there (common.registry)
    advertise_url: str | None = None  # how routers reach this worker (its pod IP)
    registry_prefix: str = "baton"
    drain_timeout_s: float = 30.0  # SIGTERM: how long in-flight work may take to finish
    # The deployment's internal token (`common.auth`): required on /internal/* when set.
    internal_token: str | None = field(default=None, repr=False)
    # Keys a client may call /v1 with directly (the internal token is accepted too); none:
    # /v1 is open (behind a router and a NetworkPolicy).
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    otlp_endpoint: str | None = None  # OTLP/HTTP traces URL (`common.tracing`); None: off
    # How `tool_choice: auto` answers are read (`worker.tool_parsers`); auto: from the
    # chat template; none: such requests are refused.
    tool_call_parser: str = "auto"
    # How a reasoning model's thinking is split from its answer (`worker.reasoning`);
    # none: not split (the thinking is content).
    reasoning_parser: str = "none"
    # SSE chunks of at least this many tokens (vLLM's --stream-interval; `worker.coalesce`)
    stream_interval: int = 1
    # The engine core in its own process (`engine.process_engine`): auto, on, off.
    engine_process: EngineProcess = EngineProcess.AUTO

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "engine_process", EngineProcess(self.engine_process))
        except ValueError:
            raise ValueError(f"WorkerSettings.engine_process={self.engine_process!r} must be "
                             f"one of {ENGINE_PROCESS_MODES}") from None
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval={self.stream_interval} must be >= 1")
        if self.registry_url is not None and not self.advertise_url:
            raise ValueError("WorkerSettings.advertise_url is needed with registry_url: the "
                             "URL routers reach this worker at (e.g. http://$POD_IP:8001)")
        try:
            object.__setattr__(self, "role", Role(self.role))
        except ValueError:
            raise ValueError(f"WorkerSettings.role={self.role!r} must be one of "
                             f"{ROLE_NAMES}") from None
        object.__setattr__(self, "served_model_name", _served_names(self.served_model_name))
        if self.max_waiting < 1:
            raise ValueError(f"WorkerSettings.max_waiting={self.max_waiting} must be >= 1")
        if self.drain_timeout_s < 0:
            raise ValueError(f"WorkerSettings.drain_timeout_s={self.drain_timeout_s} must "
                             "be >= 0")
        if self.tool_call_parser not in PARSER_CHOICES:
            raise ValueError(f"WorkerSettings.tool_call_parser={self.tool_call_parser!r} "
                             f"must be one of {PARSER_CHOICES}")
        if self.reasoning_parser not in REASONING_PARSER_CHOICES:
            raise ValueError(f"WorkerSettings.reasoning_parser={self.reasoning_parser!r} "
                             f"must be one of {REASONING_PARSER_CHOICES}")

    @property
    def model_name(self) -> str:
        """The primary name: the one responses report."""
        return self.model_names[0]

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may use for this model, the primary first."""
        if self.served_model_name:
            # __post_init__ made it a tuple (or None)
            assert isinstance(self.served_model_name, tuple)
            return self.served_model_name
        model = self.engine.checkpoint.model
        if model is None:
            return ("SmolLM2-135M-Instruct",)
        if model.startswith(SCHEME):  # hf://ORG/NAME@REV: the repo id, as vLLM names it
            return (HubRef.parse(model).repo_id,)
        if is_repo_id(model) and not os.path.exists(model):
            return (model,)
        return (os.path.basename(model.rstrip("/")).removesuffix(".gguf"),)


class WorkerState:
    """The engine (None until loaded), the request pipeline over it, the metrics, and the
    optional tuning watcher and registry registration. Lives on the event loop; `load`
    runs on a thread once, at start."""

    def __init__(self, settings: WorkerSettings, watcher: ConfigWatcher | None = None,
                 freeze_heap: bool = False) -> None:
        """`watcher`: a `common.tuning.ConfigWatcher` that read the tuning file at start.
        `freeze_heap`: this process serves this one engine for its life (`baton serve`):
        once loaded, what loading made (~10^6 objects: modules, tokenizer, imports) leaves
        the garbage collector's reach (`gc.freeze`), so a full collection scans only what
        serving makes — else ~200 ms every few hundred steps at a large batch, the device
        idle (the simulated device showed it)."""
        self.freeze_heap = freeze_heap
        self.settings = settings
        self.engine: AsyncEngine | None = None
        self.pipeline: Pipeline | None = None
        self.load_error: BaseException | None = None
        self.metrics = WorkerMetrics(self._stats, self._lora_counts)
        self.started = time.time()
        self.watcher = watcher
        self.tracing = setup_tracing(f"baton-{settings.role.value}", settings.otlp_endpoint)
        self.draining = False  # SIGTERM: finishing what runs, taking nothing new
        self.exit_code = 0  # 1 once the engine loop died
        # named on every answer (X-Baton-Worker) and the registry's record
        self.worker_id = uuid.uuid4().hex[:16]
        self.registration: Registration | None = None
        if settings.registry_url is not None:
            from baton.worker.registration import Registration

            # WorkerSettings.__post_init__ refuses registry_url without advertise_url
            assert settings.advertise_url is not None
            self.registration = Registration(settings.registry_url, settings.advertise_url,
                                             self.registry_report, settings.registry_prefix,
                                             worker_id=self.worker_id)

    def _stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None

    def _lora_counts(self) -> LoRACounts | None:
        registry = self.engine.lora_registry if self.engine is not None else None
        return registry.counters.snapshot() if registry is not None else None

    def load(self) -> None:
        """Build and start the engine (blocking: minutes for a large model)."""
        from baton.engine.process_engine import make_engine

        engine = make_engine(self.settings.engine, self.settings.engine_process)
        if self.freeze_heap:
            gc.collect()
            gc.freeze()
        engine.start()
        self.engine = engine
        settings = self.settings
        loras = engine.lora_registry
        serving = Serving(engine, self.metrics, settings.max_waiting,
                          loras.counters if loras is not None else None)
        fmt = OpenAIFormat(engine.tokenizer, settings.model_name, settings.tool_call_parser,
                           settings.reasoning_parser)
        self.pipeline = Pipeline(serving, fmt, self.tracing, priority_scheduling=(
            settings.engine.scheduler.policy == "priority"), model_names=settings.model_names,
            lora=WorkerLoRA(loras, settings.model_names),
            stream_interval=settings.stream_interval)

    def load_report(self) -> LoadReport:
        """Role, model and load (the KV pool: blocks used, total, tokens a block), and its
        LoRA adapters: what `/load` answers and the registry's heartbeat says."""
        stats, engine = self._stats() or EngineStats(), self.engine
        loras = engine.lora_registry if engine is not None else None
        return LoadReport(
            lora_adapters=loras.names() if loras is not None else [],
            lora_loaded=loras.host_names() if loras is not None else [],
            lora_roots=({n: hash_hex(r) for n, r in loras.roots().items()}
                        if loras is not None else {}),
            role=self.settings.role, model=self.settings.model_name,
            models=list(self.settings.model_names), ready=self.ready,
            running=stats.running, waiting=engine.num_waiting if engine is not None else 0,
            kv_blocks_used=stats.kv_blocks_used, kv_blocks_total=stats.kv_blocks_total,
            block_size=self.settings.engine.cache.block_size,
            max_waiting=self.settings.max_waiting,
            max_model_len=engine.max_model_len if engine is not None else None)

    def registry_report(self) -> dict | None:
        """The registry record's fields, or None while the engine is not ready."""
        if not self.ready:
            return None
        return {**self.load_report().model_dump(),
                "kv_transport": self.settings.engine.kv_transfer.transport}

    @property
    def ready(self) -> bool:
        # the pipeline is built just after the engine: ready once requests can be served
        return (self.engine is not None and self.pipeline is not None and self.engine.is_alive
                and not self.draining)

    def leases_held(self) -> int:
        """KV leases this (prefill) worker holds for decode pods to pull."""
        stats = self._stats()
        return stats.leases_held if stats is not None else 0

    def require_pipeline(self) -> Pipeline:
        """The request pipeline; a 503 OpenAIError while the model loads or the worker
        drains (a router sends the request to another worker)."""
        if self.draining:
            raise OpenAIError(503, "this worker is shutting down; retry on another",
                              code="draining", headers={"Retry-After": "1"})
        if self.pipeline is None:
            raise OpenAIError(503, "the model is still loading", code="not_ready")
        return self.pipeline


def _served_names(names: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...] | None:
    """`served_model_name` as a tuple (a single name, as older settings gave it, too);
    ValueError for an empty or repeated name."""
    if names is None or names == "":  # "": unset, as the single-name setting took it
        return None
    names = (names,) if isinstance(names, str) else tuple(names)
    if not names or not all(isinstance(n, str) and n.strip() for n in names):
        raise ValueError(f"WorkerSettings.served_model_name={names!r} must be one or more "
                         "non-empty names")
    if len(set(names)) != len(names):
        raise ValueError(f"WorkerSettings.served_model_name={names!r} repeats a name")
    return names
