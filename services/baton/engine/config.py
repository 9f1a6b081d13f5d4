"""The engine's typed, frozen configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.common.auth import MIN_TOKEN_CHARS
from baton.kv_transfer import TRANSPORTS

SCHEDULING_POLICIES = ("fcfs", "priority", "static")
KV_FAILURE_POLICIES = ("recompute", "fail")
DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# auto: the model's dtype; fp8 = fp8_e4m3 (as vLLM), stored with per-layer scales
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# The KV pool's size when nothing sizes it: a fixed budget off CUDA; on CUDA this fraction of
# the device (vLLM's default), the pool taking what the weights and activations leave.
DEFAULT_KV_CACHE_BYTES = 2 << 30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine. `model=None` means the bundled SmolLM2-135M-Instruct.

    The KV pool holds `num_kv_blocks` blocks when given, else as many as fit in
    `kv_cache_memory_bytes` when given; else, on CUDA, what `gpu_memory_utilization` of the
    device leaves after the weights and a profiled forward (`runner/memory.py`), and off
    CUDA `DEFAULT_KV_CACHE_BYTES`. `kv_pool_fraction` says which applies.
    """

    model: str | None = None
    revision: str | None = None  # a hub model's branch, tag or commit (None: main)
    # True: no tokenizer is loaded (a checkpoint without one): token-id prompts only,
    # outputs carry token ids and no text (vLLM's skip_tokenizer_init)
    skip_tokenizer_init: bool = False
    load_format: str = "auto"  # "dummy": config.json only, random weights (benchmarks)
    dtype: str = "bfloat16"
    device: str = "auto"
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None  # None: see the class docstring
    # The fraction of the CUDA device's total memory this engine may use (vLLM's meaning;
    # None: DEFAULT_GPU_MEMORY_UTILIZATION). Two engines on one GPU each take their own.
    gpu_memory_utilization: float | None = None
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES; fp8 holds 2x bf16's blocks
    scheduling_policy: str = "fcfs"
    attention_backend: str = "auto"  # auto: triton on CUDA, torch elsewhere
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps (CUDA only)
    num_threads: int | None = None
    cache_dir: str | None = None
    seed: int = 0
    # Ranks the model is split over, one process each (`runner/tp.py`): this process is
    # rank 0 and spawns the others; one GPU per rank on CUDA.
    tensor_parallel_size: int = 1
    # Disaggregation: the KV transport (None: this engine neither holds nor pulls KV),
    # how long a prefill keeps blocks for a puller, how long a pull may take, and what a
    # failed pull does to its request (prefill locally, or end it).
    kv_transport: str | None = None
    kv_host: str = "127.0.0.1"  # the address peers reach this engine's KV at (pod IP)
    kv_port: int = 0  # its port (0: any free one; fixed in a cluster for NetworkPolicies)
    engine_id: str | None = None
    kv_lease_ttl_s: float = 30.0
    kv_transfer_timeout_s: float = 30.0
    kv_failure_policy: str = "recompute"
    # The shared secret that keys the KV port's handshake (the internal token): with it,
    # only peers proving the same secret pull from or serve this engine. Never shown.
    kv_secret: str | None = field(default=None, repr=False)

    @property
    def live_settings(self) -> LiveSettings:
        """The knobs live tuning may change later, as this config starts them."""
        return LiveSettings(self.max_num_seqs, self.max_num_batched_tokens, self.kv_lease_ttl_s,
                            self.kv_transfer_timeout_s, self.kv_failure_policy)

    @property
    def kv_cache_bytes(self) -> int:
        """The KV budget when the pool is not sized from the device's memory."""
        if self.kv_cache_memory_bytes is None:
            return DEFAULT_KV_CACHE_BYTES
        return self.kv_cache_memory_bytes

    def kv_pool_fraction(self, device_type: str) -> float | None:
        """The fraction of the device the engine sizes its KV pool by on a `device_type`
        device ("cuda", "cpu"), or None when the pool has a fixed size: `num_kv_blocks` or
        `kv_cache_memory_bytes` given, or a device other than CUDA."""
        if (device_type != "cuda" or self.num_kv_blocks is not None
                or self.kv_cache_memory_bytes is not None):
            return None
        return self.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION

    def check_live(self, live: LiveSettings) -> None:
        """Raise ValueError when `live` raises a limit above this (start) config's: buffers
        and graphs are sized at start, so that needs a restart."""
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(live, name) > getattr(self, name):
                raise ValueError(f"{name}={getattr(live, name)} is above the "
                                 f"{getattr(self, name)} this engine started with; raising "
                                 "it needs a restart")

    def __post_init__(self) -> None:
        _check(self.load_format in LOAD_FORMATS, "load_format", self.load_format,
               f"must be one of {LOAD_FORMATS}")
        _check(self.dtype in DTYPES, "dtype", self.dtype, f"must be one of {DTYPES}")
        _check(self.device in DEVICES, "device", self.device, f"must be one of {DEVICES}")
        _check(0 <= self.kv_port < 65536, "kv_port", self.kv_port, "must be 0..65535")
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size", self.block_size,
               "must be a power of two in [1, 128]")
        _check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
               self.max_num_batched_tokens, "must be >= 1")
        _check(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
               self.max_model_len, "must be >= 2")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks",
               self.num_kv_blocks, "must be >= 1")
        _check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
               "kv_cache_memory_bytes", self.kv_cache_memory_bytes, "must be None or > 0")
        _check(self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
               "gpu_memory_utilization", self.gpu_memory_utilization,
               "must be None or in (0, 1]")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", self.kv_cache_dtype,
               f"must be one of {KV_CACHE_DTYPES}")
        _check(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
               self.scheduling_policy, f"must be one of {SCHEDULING_POLICIES}")
        _check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend",
               self.attention_backend, f"must be one of {ATTENTION_BACKENDS}")
        _check(self.num_threads is None or self.num_threads >= 1, "num_threads",
               self.num_threads, "must be >= 1")
        _check(1 <= self.tensor_parallel_size <= 64, "tensor_parallel_size",
               self.tensor_parallel_size, "must be in [1, 64]")
        _check(self.kv_transport in (None, "tcp") or self.tensor_parallel_size == 1,
               "tensor_parallel_size", self.tensor_parallel_size,
               f"must be 1 with kv_transport={self.kv_transport!r}: KV transfer between "
               "tensor-parallel pods (each rank its own KV heads) runs over 'tcp' only")
        _check(self.kv_transport is None or self.kv_transport in TRANSPORTS,
               "kv_transport", self.kv_transport,
               f"must be None or one of {', '.join(map(repr, TRANSPORTS))}")
        _check(self.kv_lease_ttl_s > 0, "kv_lease_ttl_s", self.kv_lease_ttl_s, "must be > 0")
        _check(self.kv_transfer_timeout_s > 0, "kv_transfer_timeout_s",
               self.kv_transfer_timeout_s, "must be > 0")
        _check(self.kv_failure_policy in KV_FAILURE_POLICIES, "kv_failure_policy",
               self.kv_failure_policy, f"must be one of {KV_FAILURE_POLICIES}")
        _check(self.kv_secret is None or len(self.kv_secret) >= MIN_TOKEN_CHARS, "kv_secret",
               "<hidden>", f"must be None or at least {MIN_TOKEN_CHARS} characters")


@dataclass(frozen=True)
class LiveKVSettings:
    """The KV connector's knobs that live tuning changes between steps."""

    lease_ttl_s: float
    transfer_timeout_s: float
    failure_policy: str  # one of KV_FAILURE_POLICIES


@dataclass(frozen=True)
class LiveSettings:
    """An engine's knobs that live tuning changes between steps (`EngineCore.reconfigure`):
    the scheduler's limits (at most the values it started with) and the KV connector's."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_lease_ttl_s: float
    kv_transfer_timeout_s: float
    kv_failure_policy: str

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            _check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        _check(self.kv_lease_ttl_s > 0, "kv_lease_ttl_s", self.kv_lease_ttl_s, "must be > 0")
        _check(self.kv_transfer_timeout_s > 0, "kv_transfer_timeout_s",
               self.kv_transfer_timeout_s, "must be > 0")
        _check(self.kv_failure_policy in KV_FAILURE_POLICIES, "kv_failure_policy",
               self.kv_failure_policy, f"must be one of {KV_FAILURE_POLICIES}")

    @property
    def kv(self) -> LiveKVSettings:
        return LiveKVSettings(self.kv_lease_ttl_s, self.kv_transfer_timeout_s,
                              self.kv_failure_policy)


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"EngineConfig.{name}={value!r} {rule}")
