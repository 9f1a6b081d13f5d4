"""The KV pool sized from a device's memory (`--gpu-memory-utilization`), through the
`DeviceMemory` interface with a simulated GPU: no GPU exists here, and the arithmetic and
the order of the calls are what the runner relies on."""

from __future__ import annotations

import pytest
import torch

from baton.engine.config import CacheConfig, EngineConfig
from baton.engine.runner.memory import GIB, DeviceMemory, KVMemoryProfiler, largest_batch

BLOCK = 2 << 20  # bytes per KV block


class FakeGPU:
    """A device shared by processes: free = total - what each holds."""

    def __init__(self, total: int = 80 * GIB) -> None:
        self.total = total
        self.processes: list[FakeProcess] = []

    def free(self) -> int:
        return self.total - sum(p.reserved_bytes + p.non_torch for p in self.processes)


class FakeProcess(DeviceMemory):
    """One process on the FakeGPU: torch's caching allocator (allocated, cached) and the
    memory outside it (its CUDA context, NCCL, cuBLAS)."""

    def __init__(self, gpu: FakeGPU, context: int = GIB // 2) -> None:
        self.gpu, self.non_torch = gpu, context  # the context exists before any call
        self.allocated_bytes = self.peak = self.reserved_bytes = 0
        self.calls: list[str] = []
        gpu.processes.append(self)

    def alloc(self, n: int) -> None:
        self.allocated_bytes += n
        self.peak = max(self.peak, self.allocated_bytes)
        self.reserved_bytes = max(self.reserved_bytes, self.allocated_bytes)

    def release(self, n: int) -> None:  # freed to torch's cache, still reserved
        self.allocated_bytes -= n

    def total(self) -> int:
        return self.gpu.total

    def free(self) -> int:
        return self.gpu.free()

    def allocated(self) -> int:
        return self.allocated_bytes

    def peak_allocated(self) -> int:
        return self.peak

    def reserved(self) -> int:
        return self.reserved_bytes

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")
        self.peak = self.allocated_bytes

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.reserved_bytes = self.allocated_bytes


def start_worker(gpu: FakeGPU, utilization: float, weights: int = 16 * GIB,
                 activations: int = 2 * GIB, overhead: int = GIB // 4):
    """A worker's start on `gpu` as the runner does it: snapshot, weights, profile (its
    activations freed, cuBLAS's workspace kept), KV pool allocated. Returns (plan, process)."""
    proc = FakeProcess(gpu)
    profiler = KVMemoryProfiler(proc, utilization)
    proc.alloc(weights)

    def profile():
        proc.calls.append("profile")
        proc.alloc(activations)
        proc.non_torch += overhead
        proc.release(activations)

    plan = profiler.plan(BLOCK, profile)
    proc.alloc(plan.num_blocks * BLOCK)
    return plan, proc


def test_the_pool_takes_the_fraction_less_weights_activations_and_overhead():
    plan, proc = start_worker(FakeGPU(), 0.9)
    assert proc.calls == ["empty_cache", "reset_peak", "profile", "empty_cache"]
    assert (plan.weights, plan.activation_peak, plan.non_torch) == (
        16 * GIB, 2 * GIB, GIB // 4)
    kv = int(80 * GIB * 0.9) - (16 * GIB + 2 * GIB + GIB // 4)
    assert plan.kv_bytes == kv and plan.num_blocks == kv // BLOCK
    # the profile's activations were freed before the peak was read: still counted
    assert proc.allocated_bytes == 16 * GIB + plan.num_blocks * BLOCK
    text = plan.describe()
    assert "weights 16.00 GiB" in text and "activation peak 2.00 GiB" in text
    assert f"{plan.num_blocks} blocks" in text


def test_two_workers_on_one_gpu_each_take_their_fraction_of_the_total():
    gpu = FakeGPU()
    prefill, _ = start_worker(gpu, 0.45)
    decode, _ = start_worker(gpu, 0.45)  # sees less free memory, same share of the total
    assert prefill.limit == decode.limit == int(80 * GIB * 0.45)
    assert prefill.num_blocks == decode.num_blocks > 0
    assert gpu.free() > 0


def test_fractions_above_what_is_free_are_refused_at_start():
    gpu = FakeGPU()
    start_worker(gpu, 0.6)
    with pytest.raises(ValueError) as err:
        start_worker(gpu, 0.6)
    text = str(err.value)
    assert "gpu_memory_utilization=0.6" in text and "48.00 GiB" in text
    assert "80.00 GiB" in text and "free" in text and "another worker" in text


def test_a_fraction_too_small_for_the_weights_names_every_number():
    with pytest.raises(ValueError) as err:
        start_worker(FakeGPU(), 0.2)  # 16 GiB, the weights alone take 16
    text = str(err.value)
    for part in ("no KV cache fits", "gpu_memory_utilization=0.2", "16.00 GiB",
                 "weights 16.00 GiB", "activation peak 2.00 GiB", "non-torch 0.25 GiB",
                 "--gpu-memory-utilization"):
        assert part in text, part


def test_the_profile_peak_decides_the_pool():
    small, _ = start_worker(FakeGPU(), 0.9, activations=GIB)
    large, _ = start_worker(FakeGPU(), 0.9, activations=9 * GIB)
    assert small.kv_bytes - large.kv_bytes == 8 * GIB


def test_memory_another_process_takes_meanwhile_is_an_error_not_an_oom():
    gpu = FakeGPU()
    proc = FakeProcess(gpu)
    profiler = KVMemoryProfiler(proc, 0.5)
    other = FakeProcess(gpu, context=0)
    proc.alloc(10 * GIB)

    def profile():
        other.alloc(60 * GIB)  # counted as this process's overhead: no block fits

    with pytest.raises(ValueError, match="no KV cache fits"):
        profiler.plan(BLOCK, profile)


def test_which_setting_sizes_the_pool():
    assert EngineConfig().cache.pool_fraction("cuda") == 0.9
    assert EngineConfig.from_args(gpu_memory_utilization=0.4).cache.pool_fraction("cuda") == 0.4
    assert EngineConfig.from_args(gpu_memory_utilization=0.4).cache.pool_fraction("cpu") is None
    assert EngineConfig.from_args(num_kv_blocks=8).cache.pool_fraction("cuda") is None
    assert EngineConfig.from_args(kv_cache_memory_bytes=GIB).cache.pool_fraction("cuda") is None
    assert EngineConfig().cache.budget_bytes == 2 * GIB  # CPU's default, unchanged


def test_the_largest_batch_fills_the_token_budget_without_writing_kv():
    ids, positions, layout = largest_batch(2048, 128, 512, 16, torch.device("cpu"))
    assert layout.seq_lens == [512] * 4 and layout.query_start_loc[-1] == 2048
    assert ids.shape == positions.shape == (2048,) and int(positions.max()) == 511
    assert bool((layout.slot_mapping == -1).all()) and int(layout.block_tables.max()) == 0
    assert layout.block_tables.shape == (4, 32) and layout.num_decodes == 0
    _, _, few = largest_batch(2048, 2, 512, 16, torch.device("cpu"))
    assert few.seq_lens == [512, 512]  # at most max_num_seqs sequences


def test_the_runner_profiles_after_the_weights_and_sizes_its_cache_by_the_plan(
        tmp_path, monkeypatch):
    """The runner's wiring, on CPU: the device's memory read through a fake, the largest
    forward run for real over a one-block cache before the pool exists."""
    from baton.engine.runner import model_runner
    from tests.unit.engine.tiny_checkpoint import save_tiny_llama

    model_dir = save_tiny_llama(tmp_path / "m")
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 2  # K/V x layers x tokens x heads x dim x bf16
    gpu = FakeGPU(total=75 * bytes_per_block)
    proc = FakeProcess(gpu, context=0)  # the fraction 0.5 holds 37.5 blocks
    monkeypatch.setattr(model_runner, "CudaMemory", lambda device: proc)
    monkeypatch.setattr(CacheConfig, "pool_fraction", lambda self, device_type: 0.5)
    profiled = []
    original = model_runner.ModelRunner._profile_forward

    def profile(runner, max_model_len):
        profiled.append((hasattr(runner, "kv_cache"), max_model_len))
        original(runner, max_model_len)

    monkeypatch.setattr(model_runner.ModelRunner, "_profile_forward", profile)
    config = EngineConfig.from_args(model=str(model_dir), skip_tokenizer_init=True, num_threads=1,
                          max_num_batched_tokens=300, max_num_seqs=4)
    runner = model_runner.ModelRunner(config, model_dir, max_model_len=128)
    assert profiled == [(False, 128)]  # once, before the KV cache existed
    assert proc.calls == ["empty_cache", "reset_peak", "empty_cache"]
    assert runner.bytes_per_block == bytes_per_block
    assert runner.num_blocks == runner.kv_memory.num_blocks == 37
    assert runner.kv_cache.shape[2] == 37


def test_memory_this_process_freed_before_counts_as_free():
    """An engine closed earlier in the same process left its memory in torch's cache: given
    back before the start check, it does not look like another process's."""
    gpu = FakeGPU()
    proc = FakeProcess(gpu)
    proc.alloc(60 * GIB)
    proc.release(60 * GIB)  # cached, still reserved: free() says 19.5 GiB
    KVMemoryProfiler(proc, 0.9)  # 72 GiB asked: only fits once the cache is given back
    assert proc.calls == ["empty_cache"]
