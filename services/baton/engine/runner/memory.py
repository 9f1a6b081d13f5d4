"""The KV pool sized from a CUDA device's memory: `--gpu-memory-utilization`, as vLLM means it.

The engine may use `utilization` x the device's TOTAL memory, whatever other processes on the
device hold (two workers sharing one GPU each take their own fraction). The runner:

1. before the weights load, takes a snapshot of the device (`KVMemoryProfiler`): the
   fraction must be free at all, else another process (the other worker on a shared GPU)
   holds part of it and the fractions together exceed the device;
2. after the weights load and before any KV cache exists, runs one forward of the largest
   batch the scheduler can make, over a cache of one block (`largest_batch`);
3. sizes the pool: budget = total x utilization - what this process holds (its torch peak
   during that forward: weights + activations, plus the drop in free memory that torch's
   own reservation does not explain: the CUDA context's growth, NCCL, cuBLAS), and
   blocks = budget // bytes per block (`KVMemoryPlan`).

The device is read through `DeviceMemory` only, so the arithmetic and the order of the calls
are tested on CPU with a fake device. Processes that profile on one GPU at the same moment
count each other's allocations as their own overhead (as vLLM's profile does): start the
second worker of a shared GPU once the first is ready.
"""

from __future__ import annotations

import gc
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from baton.engine.attention.base import BatchLayout

GIB = 1 << 30


class DeviceMemory(ABC):
    """One device's memory as the KV sizing reads it; called from the thread building the
    engine. Bytes throughout."""

    @abstractmethod
    def total(self) -> int:
        """The device's memory."""

    @abstractmethod
    def free(self) -> int:
        """Free on the device now, whichever processes hold the rest."""

    @abstractmethod
    def allocated(self) -> int:
        """Held by this process's tensors now."""

    @abstractmethod
    def peak_allocated(self) -> int:
        """The most `allocated` reached since the last `reset_peak`."""

    @abstractmethod
    def reserved(self) -> int:
        """Held by torch's caching allocator in this process (allocated + cached)."""

    @abstractmethod
    def reset_peak(self) -> None:
        """Start `peak_allocated` again from `allocated`."""

    @abstractmethod
    def empty_cache(self) -> None:
        """Give the allocator's cached, unallocated memory back to the device."""


class CudaMemory(DeviceMemory):
    """`DeviceMemory` over torch.cuda's counters for `device`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def total(self) -> int:
        return torch.cuda.mem_get_info(self.device)[1]

    def free(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_stats(self.device).get("reserved_bytes.all.current", 0)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def empty_cache(self) -> None:
        gc.collect()  # tensors only a reference cycle still holds (an engine closed before)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


def gib(n: int | float) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class KVMemoryPlan:
    """What the profile measured (bytes) and the KV pool it leaves room for."""

    total: int
    utilization: float
    weights: int  # this process's tensors after the weights loaded
    activation_peak: int  # the profiled forward's peak above the weights
    non_torch: int  # the drop in free memory torch's reservation does not explain
    free: int  # free on the device after the profile, its cache given back
    bytes_per_block: int

    @property
    def limit(self) -> int:
        """The engine's share of the device."""
        return int(self.total * self.utilization)

    @property
    def used(self) -> int:
        return self.weights + self.activation_peak + self.non_torch

    @property
    def kv_bytes(self) -> int:
        """The KV pool's budget: the share less what the engine already uses."""
        return self.limit - self.used

    @property
    def num_blocks(self) -> int:
        return max(0, self.kv_bytes) // self.bytes_per_block

    def describe(self) -> str:
        return (f"gpu_memory_utilization={self.utilization} of {gib(self.total)} = "
                f"{gib(self.limit)}: weights {gib(self.weights)}, activation peak "
                f"{gib(self.activation_peak)}, non-torch {gib(self.non_torch)}, KV cache "
                f"{gib(max(0, self.kv_bytes))} = {self.num_blocks} blocks of "
                f"{self.bytes_per_block} bytes; {gib(self.free)} free on the device")

    def check(self) -> None:
        """Raise ValueError, naming every number, when the budget holds no block or more
        than the device has free (another process took memory since the start)."""
        if self.num_blocks < 1:
            raise ValueError(
                f"no KV cache fits: {self.describe()}. Raise --gpu-memory-utilization, "
                "lower --max-num-batched-tokens / --max-num-seqs, or size the pool "
                "yourself (--num-kv-blocks, --kv-cache-gib)")
        if self.kv_bytes > self.free:
            raise ValueError(
                f"the KV cache does not fit in what is free: {self.describe()}. Another "
                "process took memory on this device while the engine started (another "
                "worker on the GPU?): lower --gpu-memory-utilization here or there")


@dataclass(frozen=True)
class MemorySnapshot:
    free: int
    reserved: int

    @classmethod
    def take(cls, memory: DeviceMemory) -> MemorySnapshot:
        return cls(memory.free(), memory.reserved())


class KVMemoryProfiler:
    """Created before the weights load (it takes the start snapshot); `plan` after them."""

    def __init__(self, memory: DeviceMemory, utilization: float) -> None:
        """Raise ValueError when the engine's share of the device is not free now: the
        processes already on it (another worker sharing the GPU) and this one's fraction
        together exceed it."""
        self.memory = memory
        self.utilization = utilization
        memory.empty_cache()  # what this process freed before (an earlier engine) is free
        self.start = MemorySnapshot.take(memory)
        total = memory.total()
        if total * utilization > self.start.free:
            raise ValueError(
                f"EngineConfig.gpu_memory_utilization={utilization} asks for "
                f"{gib(total * utilization)} of the device's {gib(total)}, but only "
                f"{gib(self.start.free)} is free ({gib(total - self.start.free)} held by "
                "other processes, e.g. another worker on this GPU). Lower it so the "
                "fractions of every process on the device add up to what it has")

    def plan(self, bytes_per_block: int, profile: Callable[[], None]) -> KVMemoryPlan:
        """Run `profile` (the largest forward, its tensors freed when it returns) and size
        the pool; raises ValueError (`KVMemoryPlan.check`) when no block fits."""
        memory = self.memory
        weights = memory.allocated()
        memory.reset_peak()
        profile()
        peak = memory.peak_allocated()
        after = MemorySnapshot.take(memory)
        non_torch = ((self.start.free - after.free)
                     - (after.reserved - self.start.reserved))
        memory.empty_cache()
        plan = KVMemoryPlan(total=memory.total(), utilization=self.utilization,
                            weights=weights, activation_peak=max(0, peak - weights),
                            non_torch=max(0, non_torch), free=memory.free(),
                            bytes_per_block=bytes_per_block)
        plan.check()
        return plan


def largest_batch(max_tokens: int, max_seqs: int, max_model_len: int, block_size: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, BatchLayout]:
    """(input_ids, positions, layout) of the largest step the scheduler can make:
    `max_tokens` prompt tokens from the start of as few sequences as `max_model_len` allows
    (at most `max_seqs`). Every block table entry is block 0 and no slot is written, so a
    cache of one block serves it."""
    lens: list[int] = []
    left = max_tokens
    while left > 0 and len(lens) < max_seqs:
        lens.append(min(left, max_model_len))
        left -= lens[-1]
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    total = qsl[-1]
    positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]).to(device)
    table = torch.zeros(len(lens), -(-max(lens) // block_size), dtype=torch.int64,
                        device=device)  # (B, blocks)
    layout = BatchLayout(query_start_loc=qsl, context_lens=[0] * len(lens), seq_lens=lens,
                         num_decodes=0, block_tables=table,
                         slot_mapping=torch.full((total,), -1, dtype=torch.int64,
                                                 device=device),
                         block_size=block_size)
    return torch.zeros(total, dtype=torch.int64, device=device), positions, layout
