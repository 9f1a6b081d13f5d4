"""The engine's typed, frozen configuration: one group per concern (`EngineConfig.checkpoint`,
`.compute`, `.cache`, `.scheduler`, `.parallel`, `.kv_transfer`), each validated once.

The flat argument names — `LLM(model, dtype=...)`'s keywords, the CLI flags' dests, the tuning
file's `worker` keys, the TP follower spec — map onto the groups in one table, `ARGS`
(`EngineConfig.from_args`, `EngineConfig.args`), the way vLLM's flat `EngineArgs` build its
grouped config. Errors name the flat argument, as the user typed it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from functools import reduce
from typing import Any

from baton.common.auth import MIN_TOKEN_CHARS
from baton.engine.config_values import (  # noqa: F401 - re-exported: the accepted values
    ATTENTION_BACKENDS,
    DEVICES,
    DTYPES,
    ENGINE_PROCESS_MODES,
    KV_CACHE_DTYPES,
    KV_FAILURE_POLICIES,
    LOAD_FORMATS,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    AttentionBackendName,
    Device,
    DType,
    EngineProcess,
    KVCacheDType,
    KVFailurePolicy,
    LoadFormat,
    Quantization,
    SchedulingPolicy,
    accepted,
)
from baton.engine.lora.config import LoRAConfig
from baton.engine.spec.config import SpeculativeConfig
from baton.kv_transfer import TRANSPORTS


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"EngineConfig.{name}={value!r} {rule}")


def _coerce(config: object, name: str, enum: type[StrEnum], arg: str) -> None:
    """Turn field `name` of the frozen `config` into its `enum` member; ValueError naming the
    flat argument `arg` for a value outside it."""
    value = getattr(config, name)
    _check(value in accepted(enum), arg, value, f"must be one of {accepted(enum)}")
    object.__setattr__(config, name, enum(value))


# The KV pool's size when nothing sizes it: a fixed budget off CUDA; on CUDA this fraction of
# the device (vLLM's default), the pool taking what the weights and activations leave.
DEFAULT_KV_CACHE_BYTES = 2 << 30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class CheckpointConfig:
    """Which weights, how they load, at which dtype and context length. `model=None` means
    the bundled SmolLM2-135M-Instruct."""

    model: str | None = None
    revision: str | None = None  # a hub model's branch, tag or commit (None: main)
    # True: no tokenizer is loaded (a checkpoint without one): token-id prompts only,
    # outputs carry token ids and no text (vLLM's skip_tokenizer_init)
    skip_tokenizer_init: bool = False
    load_format: LoadFormat = LoadFormat.AUTO
    dtype: DType = DType.BFLOAT16
    # auto: a GGUF's quantized linears served as stored (platforms/cpu_quant.py; elsewhere,
    # or for other checkpoints, a no-op); none: de-quantized to `dtype` at load. auto is the
    # default: on the bundled model it decodes 2.4x as fast as bf16 at batch 1, 1.1x at 32
    quantization: Quantization = Quantization.AUTO
    max_model_len: int | None = None  # None: the model's, capped by the KV pool
    cache_dir: str | None = None  # where downloads and compiled kernels are kept

    def __post_init__(self) -> None:
        _coerce(self, "load_format", LoadFormat, "load_format")
        _coerce(self, "dtype", DType, "dtype")
        _coerce(self, "quantization", Quantization, "quantization")
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
               self.max_model_len, "must be >= 2")


@dataclass(frozen=True)
class ComputeConfig:
    """Where and how the forward passes run."""

    device: Device = Device.AUTO
    attention_backend: AttentionBackendName = AttentionBackendName.AUTO
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps (CUDA only)
    num_threads: int | None = None  # torch's CPU threads (None: every core)
    seed: int = 0  # the sampler's
    # True: batch-invariant forward passes (CPU only): a token's logits the same bits
    # whatever else is in its step, prefill chunk or decode (platforms/cpu.py)
    deterministic: bool = False
    sim_profile: str | None = None  # --device sim's GPU x model (engine.sim)

    def __post_init__(self) -> None:
        _coerce(self, "device", Device, "device")
        _check((self.device == Device.SIM) == (self.sim_profile is not None), "sim_profile",
               self.sim_profile, "must name a profile exactly when device is 'sim'")
        _coerce(self, "attention_backend", AttentionBackendName, "attention_backend")
        _check(self.num_threads is None or self.num_threads >= 1, "num_threads",
               self.num_threads, "must be >= 1")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache. The pool holds `num_kv_blocks` blocks when given, else as many as
    fit in `kv_cache_memory_bytes` when given; else, on CUDA, what `gpu_memory_utilization` of
    the device leaves after the weights and a profiled forward (`runner/memory.py`), and off
    CUDA `DEFAULT_KV_CACHE_BYTES`. `pool_fraction` says which applies."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    # The fraction of the CUDA device's total memory this engine may use (vLLM's meaning;
    # None: DEFAULT_GPU_MEMORY_UTILIZATION). Two engines on one GPU each take their own.
    gpu_memory_utilization: float | None = None
    kv_cache_dtype: KVCacheDType = KVCacheDType.AUTO  # fp8 holds 2x bf16's blocks
    kv_offload_gib: float = 0.0  # the host tier under the pool (`engine.kv_tier`); 0: none
    kv_disk_dir: str | None = None  # the disk tier under the host tier; None: none
    kv_disk_gib: float = 0.0

    def __post_init__(self) -> None:
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", self.block_size,
               "must be a power of two in [1, 128]")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks",
               self.num_kv_blocks, "must be >= 1")
        _check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
               "kv_cache_memory_bytes", self.kv_cache_memory_bytes, "must be None or > 0")
        _check(self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
               "gpu_memory_utilization", self.gpu_memory_utilization, "must be None or in (0, 1]")
        _coerce(self, "kv_cache_dtype", KVCacheDType, "kv_cache_dtype")
        _check(self.kv_offload_gib >= 0, "kv_offload_gib", self.kv_offload_gib, "must be >= 0")
        _check((self.kv_disk_dir is None) == (self.kv_disk_gib == 0) and self.kv_disk_gib >= 0
               and (self.kv_disk_dir is None or self.kv_offload_gib > 0), "kv_disk_gib",
               self.kv_disk_gib, "must be > 0 exactly when kv_disk_dir is set, and the disk "
               "tier needs the host tier above it (kv_offload_gib > 0)")

    @property
    def budget_bytes(self) -> int:
        """The KV budget when the pool is not sized from the device's memory."""
        if self.kv_cache_memory_bytes is None:
            return DEFAULT_KV_CACHE_BYTES
        return self.kv_cache_memory_bytes

    def pool_fraction(self, device_type: str) -> float | None:
        """The fraction of the device the engine sizes its KV pool by on a `device_type`
        device ("cuda", "cpu"), or None when the pool has a fixed size: `num_kv_blocks` or
        `kv_cache_memory_bytes` given, or a device other than CUDA."""
        if (device_type != "cuda" or self.num_kv_blocks is not None
                or self.kv_cache_memory_bytes is not None):
            return None
        return self.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits (live-tunable down to the start values) and policy."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    # `dynamic` policy: a group starts once max_num_seqs requests wait or its oldest has
    # waited this long
    batch_window_ms: float = 10.0
    # Schedule step N+1 while step N runs (`EngineCore`): True / False, None (auto): on when
    # the device runs a step while the host goes on (the simulated device; see
    # docs/design.md), off with speculative decoding or the static / dynamic baselines
    async_scheduling: bool | None = None
    # Speculative decoding (`engine.spec`); as a flat argument the JSON of
    # `--speculative-config` (None: off)
    speculative: SpeculativeConfig = SpeculativeConfig()

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            _check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        _coerce(self, "policy", SchedulingPolicy, "scheduling_policy")
        _check(self.batch_window_ms >= 0, "batch_window_ms", self.batch_window_ms, "must be >= 0")
        object.__setattr__(self, "speculative", SpeculativeConfig.parse(self.speculative))


@dataclass(frozen=True)
class ParallelConfig:
    # Ranks the model is split over, one process each (`runner/tp.py`): this process is
    # rank 0 and spawns the others; one GPU per rank on CUDA.
    tensor_parallel_size: int = 1
    # A step the ranks do not finish within this fails the engine (a rank stopped, a
    # collective hung): the worker exits and is restarted instead of serving nothing.
    step_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        _check(1 <= self.tensor_parallel_size <= 64, "tensor_parallel_size",
               self.tensor_parallel_size, "must be in [1, 64]")
        _check(self.step_timeout_s > 0, "tp_step_timeout_s", self.step_timeout_s,
               "must be > 0")


@dataclass(frozen=True)
class LiveKVSettings:
    """The KV connector's knobs that live tuning changes between steps: how long a prefill
    keeps blocks for a puller, how long a pull may take, and what a failed pull does."""

    lease_ttl_s: float = 30.0
    transfer_timeout_s: float = 30.0
    failure_policy: KVFailurePolicy = KVFailurePolicy.RECOMPUTE

    def __post_init__(self) -> None:
        _check(self.lease_ttl_s > 0, "kv_lease_ttl_s", self.lease_ttl_s, "must be > 0")
        _check(self.transfer_timeout_s > 0, "kv_transfer_timeout_s", self.transfer_timeout_s,
               "must be > 0")
        _coerce(self, "failure_policy", KVFailurePolicy, "kv_failure_policy")


@dataclass(frozen=True)
class KVTransferConfig:
    """Disaggregation: the KV transport (None: this engine neither holds nor pulls KV), where
    peers reach this engine's KV, and the live knobs."""

    transport: str | None = None  # a name in kv_transfer.TRANSPORTS
    host: str = "127.0.0.1"  # the address peers reach this engine's KV at (pod IP)
    port: int = 0  # its port (0: any free one; fixed in a cluster for NetworkPolicies)
    engine_id: str | None = None
    live: LiveKVSettings = LiveKVSettings()
    # The shared secret that keys the KV port's handshake (the internal token): with it,
    # only peers proving the same secret pull from or serve this engine. Never shown.
    secret: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _check(self.transport is None or self.transport in TRANSPORTS, "kv_transport",
               self.transport, f"must be None or one of {', '.join(map(repr, TRANSPORTS))}")
        _check(0 <= self.port < 65536, "kv_port", self.port, "must be 0..65535")
        _check(self.secret is None or len(self.secret) >= MIN_TOKEN_CHARS, "kv_secret",
               "<hidden>", f"must be None or at least {MIN_TOKEN_CHARS} characters")


@dataclass(frozen=True)
class LiveSettings:
    """An engine's knobs that live tuning changes between steps (`EngineCore.reconfigure`):
    the scheduler's limits (at most the values it started with) and the KV connector's."""

    scheduler: SchedulerConfig
    kv: LiveKVSettings


# flat argument -> its place in EngineConfig (group, field[, field])
ARGS: dict[str, tuple[str, ...]] = {
    **{name: ("checkpoint", name) for name in (
        "model", "revision", "skip_tokenizer_init", "load_format", "dtype", "quantization",
        "max_model_len", "cache_dir")},
    **{name: ("compute", name) for name in (
        "device", "attention_backend", "enforce_eager", "num_threads", "seed",
        "deterministic", "sim_profile")},
    **{name: ("cache", name) for name in (
        "block_size", "enable_prefix_caching", "num_kv_blocks", "kv_cache_memory_bytes",
        "gpu_memory_utilization", "kv_cache_dtype", "kv_offload_gib",
        "kv_disk_dir", "kv_disk_gib")},
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"),
    "max_num_seqs": ("scheduler", "max_num_seqs"),
    "scheduling_policy": ("scheduler", "policy"),
    "batch_window_ms": ("scheduler", "batch_window_ms"),
    "async_scheduling": ("scheduler", "async_scheduling"),
    "speculative_config": ("scheduler", "speculative"),
    "tensor_parallel_size": ("parallel", "tensor_parallel_size"),
    "tp_step_timeout_s": ("parallel", "step_timeout_s"),
    "kv_transport": ("kv_transfer", "transport"),
    "kv_host": ("kv_transfer", "host"),
    "kv_port": ("kv_transfer", "port"),
    "engine_id": ("kv_transfer", "engine_id"),
    "kv_secret": ("kv_transfer", "secret"),
    "kv_lease_ttl_s": ("kv_transfer", "live", "lease_ttl_s"),
    "kv_transfer_timeout_s": ("kv_transfer", "live", "transfer_timeout_s"),
    "kv_failure_policy": ("kv_transfer", "live", "failure_policy"),
    "enable_lora": ("lora", "enable"),
    **{name: ("lora", name.removeprefix("lora_")) for name in (
        "lora_modules", "max_loras", "max_lora_rank", "max_cpu_loras")},
}
# The flat arguments live tuning may change on a running engine
LIVE_ARGS = ("max_num_seqs", "max_num_batched_tokens", "kv_lease_ttl_s",
             "kv_transfer_timeout_s", "kv_failure_policy", "speculative_config")


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine, by concern. Build it from flat arguments with `from_args`."""

    checkpoint: CheckpointConfig = CheckpointConfig()
    compute: ComputeConfig = ComputeConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    kv_transfer: KVTransferConfig = KVTransferConfig()
    lora: LoRAConfig = LoRAConfig()  # `engine.lora`

    def __post_init__(self) -> None:
        transport = self.kv_transfer.transport
        _check(transport in (None, "tcp") or self.parallel.tensor_parallel_size == 1,
               "tensor_parallel_size", self.parallel.tensor_parallel_size,
               f"must be 1 with kv_transport={transport!r}: KV transfer between "
               "tensor-parallel pods (each rank its own KV heads) runs over 'tcp' only")
        _check(not self.compute.deterministic or self.parallel.tensor_parallel_size == 1,
               "tensor_parallel_size", self.parallel.tensor_parallel_size,
               "must be 1 with deterministic=True: the all-reduce of more ranks sums in an "
               "order that depends on the batch's size")
        self.lora.check_with(self.parallel.tensor_parallel_size, self.compute.deterministic,
                             self.scheduler.speculative.method)

    @classmethod
    def from_args(cls, **args: Any) -> EngineConfig:
        """The config the flat arguments (names in `ARGS`) give; the rest default. Raises
        TypeError for an unknown argument, ValueError naming the first bad value."""
        unknown = sorted(set(args) - ARGS.keys())
        if unknown:
            raise TypeError(f"EngineConfig has no argument {unknown[0]!r}; known: "
                            f"{', '.join(ARGS)}")
        groups: dict[str, dict[str, Any]] = {}
        live: dict[str, Any] = {}
        for name, value in args.items():
            group, *path = ARGS[name]
            (live if path[0] == "live" else groups.setdefault(group, {}))[path[-1]] = value
        return cls(CheckpointConfig(**groups.get("checkpoint", {})),
                   ComputeConfig(**groups.get("compute", {})),
                   CacheConfig(**groups.get("cache", {})),
                   SchedulerConfig(**groups.get("scheduler", {})),
                   ParallelConfig(**groups.get("parallel", {})),
                   KVTransferConfig(live=LiveKVSettings(**live), **groups.get("kv_transfer", {})),
                   LoRAConfig(**groups.get("lora", {})))

    def args(self) -> dict[str, Any]:
        """The flat arguments that rebuild this config (`from_args(**c.args()) == c`)."""
        return {name: self.arg(name) for name in ARGS}

    def arg(self, name: str) -> Any:
        """The value of flat argument `name`, an enum's as its string (KeyError for one not
        in `ARGS`)."""
        value = reduce(getattr, ARGS[name], self)
        if isinstance(value, SpeculativeConfig):
            return value.to_json()
        if name == "lora_modules":  # as the CLI takes them (and JSON keeps them)
            return [f"{n}={p}" for n, p in self.lora.modules]
        return value.value if isinstance(value, StrEnum) else value

    def with_args(self, **args: Any) -> EngineConfig:
        """This config with the flat arguments `args` changed (validated as `from_args`)."""
        return EngineConfig.from_args(**{**self.args(), **args})

    @staticmethod
    def default(name: str) -> Any:
        """The default of flat argument `name`, for a flag's default (ValueError for a name
        not in `ARGS`, so a renamed field fails when the parser is built)."""
        if name not in ARGS:
            raise ValueError(f"EngineConfig has no argument {name!r}")
        return _DEFAULT.arg(name)

    @property
    def live_settings(self) -> LiveSettings:
        """The knobs live tuning may change later, as this config starts them."""
        return LiveSettings(self.scheduler, self.kv_transfer.live)

    def check_live(self, live: LiveSettings) -> None:
        """Raise ValueError when `live` raises a limit above this (start) config's: buffers
        and graphs are sized at start, so that needs a restart."""
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            asked, started = getattr(live.scheduler, name), getattr(self.scheduler, name)
            if asked > started:
                raise ValueError(f"{name}={asked} is above the {started} this engine started "
                                 "with; raising it needs a restart")
        draft = live.scheduler.speculative.draft_model
        if draft is not None and draft != self.scheduler.speculative.draft_model:
            raise ValueError(f"speculative_config.draft_model={draft!r} is not the draft this "
                             "engine loaded at start; loading another needs a restart")


_DEFAULT = EngineConfig()
