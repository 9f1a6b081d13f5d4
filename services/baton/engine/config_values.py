"""The values the engine's configuration accepts: one `StrEnum` per choice, and the strings
of each (`DTYPES`, `DEVICES`, ...) for CLI choices and messages. Re-exported by
`engine.config`."""

from __future__ import annotations

from enum import StrEnum


class DType(StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class Device(StrEnum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"
    SIM = "sim"  # a simulated GPU (`engine.sim`): modelled step times, nonsense tokens


class EngineProcess(StrEnum):
    """Where a worker runs its engine core (`engine.process_engine`): its own process, or
    a thread of the HTTP front's; auto: its own for a GPU and the simulated device."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"

    def runs_apart(self, device: Device) -> bool:
        """Whether the core gets its own process on `device` (AUTO: an unresolved device
        is a GPU when torch sees one)."""
        if self != EngineProcess.AUTO:
            return self == EngineProcess.ON
        if device == Device.AUTO:
            import torch

            return torch.cuda.is_available()
        return device in (Device.CUDA, Device.SIM)


class LoadFormat(StrEnum):
    AUTO = "auto"
    DUMMY = "dummy"  # config.json only, random weights (benchmarks)


class Quantization(StrEnum):
    NONE = "none"  # quantized checkpoints are de-quantized to `dtype` at load
    # a GGUF's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K linears, a GPTQ / AWQ / compressed-tensors
    # checkpoint's int4 / int8 ones, kept quantized (CPU, bf16; `engine.quant`)
    AUTO = "auto"


class AttentionBackendName(StrEnum):
    AUTO = "auto"  # triton on CUDA, torch elsewhere
    TORCH = "torch"
    TRITON = "triton"


class KVCacheDType(StrEnum):
    AUTO = "auto"  # the model's dtype
    FP8 = "fp8"  # = fp8_e4m3 (as vLLM), stored with per-layer scales
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"


class SchedulingPolicy(StrEnum):
    FCFS = "fcfs"
    PRIORITY = "priority"
    STATIC = "static"
    DYNAMIC = "dynamic"  # static groups, each collected within a window (--batch-window-ms)


class KVFailurePolicy(StrEnum):
    RECOMPUTE = "recompute"  # a failed pull prefills the request locally
    FAIL = "fail"  # a failed pull ends the request


def accepted(enum: type[StrEnum]) -> tuple[str, ...]:
    """The strings `enum` accepts."""
    return tuple(member.value for member in enum)


# The accepted strings, for CLI choices and messages
DTYPES = accepted(DType)
DEVICES = accepted(Device)
ENGINE_PROCESS_MODES = accepted(EngineProcess)
LOAD_FORMATS = accepted(LoadFormat)
QUANTIZATIONS = accepted(Quantization)
ATTENTION_BACKENDS = accepted(AttentionBackendName)
KV_CACHE_DTYPES = accepted(KVCacheDType)
SCHEDULING_POLICIES = accepted(SchedulingPolicy)
KV_FAILURE_POLICIES = accepted(KVFailurePolicy)
