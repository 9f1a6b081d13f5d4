"""Where the model runs: `Platform` (`base.py`) and one per device kind — `CpuPlatform` (the
`baton_cpu` kernels), `CudaPlatform` (kernel warm-up, CUDA graphs)."""

from __future__ import annotations

from pathlib import Path

import torch

from baton.engine.platforms.base import FastDecode, Platform

__all__ = ["FastDecode", "Platform", "make_platform"]


def make_platform(device: torch.device, cache_dir: Path, cuda_graphs: bool = True,
                  deterministic: bool = False) -> Platform:
    """The platform of `device`: `cache_dir` is where the CPU kernels are built;
    `cuda_graphs` False (`--enforce-eager`) runs CUDA decode steps eagerly; `deterministic`
    asks for batch-invariant kernels (CPU only: ValueError elsewhere). Other devices (mps,
    ...) run the model's torch code as it is."""
    if deterministic and device.type != "cpu":
        raise ValueError(f"deterministic=True runs on CPU only: there are no batch-invariant "
                         f"kernels for {device.type} yet; use --device cpu or drop "
                         "--deterministic")
    if device.type == "cpu":
        from baton.engine.platforms.cpu import CpuPlatform

        return CpuPlatform(cache_dir, deterministic)
    if device.type == "cuda":
        from baton.engine.platforms.cuda import CudaPlatform

        return CudaPlatform(cuda_graphs)
    return Platform()
