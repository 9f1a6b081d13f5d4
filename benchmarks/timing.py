"""Timing helpers shared by the benchmarks: calls timed on CPU or CUDA, and the device's
copy and read bandwidths, the yardsticks for memory-bound work (weights, KV reads)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Hand the allocator's freed blocks back, so that free memory reads true."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_calls(fn: Callable[[], object], device: torch.device, repeats: int,
               warmup: int = 2) -> list[float]:
    """Seconds per call of `fn`, `repeats` times after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def measure_copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> dict:
    """`dst.copy_(src)` of `nbytes`; GB/s count the bytes moved, read + write (2 x size), from
    the best and the median call."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = time_calls(lambda: dst.copy_(src), device, repeats)
    best, median = min(times), statistics.median(times)
    return {"bytes": nbytes, "best_s": best, "gbps": 2 * nbytes / best / 1e9,
            "median_gbps": 2 * nbytes / median / 1e9}


def measure_read_bandwidth(device: torch.device, nbytes: int, repeats: int) -> dict:
    """One pass reading `nbytes` of bfloat16 (a `sum`, the way a decode step streams its
    weights); GB/s count the bytes read, from the best and the median call."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    times = time_calls(src.sum, device, repeats)
    best, median = min(times), statistics.median(times)
    return {"bytes": nbytes, "best_s": best, "gbps": nbytes / best / 1e9,
            "median_gbps": nbytes / median / 1e9, "times": times}
