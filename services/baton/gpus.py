"""Which GPUs `baton up`'s workers run on, and how much of a shared one each may take.

`baton up --device cuda` starts every worker on this machine. With a GPU per rank for every
worker, each worker gets its own (`CUDA_VISIBLE_DEVICES` narrowed to its slice, so its rank
r is its `cuda:r`); with fewer, the workers share the first GPUs (a prefill and a decode
worker on one device is the local GPU demo). Sharing workers split the default memory
fraction between them, unless a KV pool size is given, and start one after another, so
each profiles its activation memory against what the ones before it really hold (as two
vLLM servers on one GPU must). Imports no torch: the GPUs are read from
`CUDA_VISIBLE_DEVICES` or `nvidia-smi -L`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from baton.engine.config import DEFAULT_GPU_MEMORY_UTILIZATION

_SIZING_FLAGS = ("--gpu-memory-utilization", "--kv-cache-gib", "--num-kv-blocks")


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """The GPU ids workers may use: `CUDA_VISIBLE_DEVICES` when set (empty: none), else
    one per line of `nvidia-smi -L` (none without the tool)."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        return [g.strip() for g in env["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


@dataclass(frozen=True)
class GpuPlan:
    devices: list[list[str]]  # per worker: the GPU ids of its ranks
    fraction: float | None  # per worker, when they share and no pool size was given
    shared: bool  # some GPU holds more than one worker: start them one at a time

    def env(self, i: int) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.devices[i])}

    def args(self) -> list[str]:
        return [] if self.fraction is None else ["--gpu-memory-utilization",
                                                 f"{self.fraction:g}"]


def plan_gpus(ranks: list[int], gpus: list[str], worker_args: list[str]) -> GpuPlan:
    """Place workers of `ranks[i]` tensor-parallel ranks each on `gpus`. ValueError when a
    worker needs more GPUs than there are."""
    if not gpus:
        raise ValueError("--device cuda: no GPU visible (CUDA_VISIBLE_DEVICES is empty or "
                         "nvidia-smi lists none)")
    if max(ranks) > len(gpus):
        raise ValueError(f"a worker with {max(ranks)} tensor-parallel ranks needs as many "
                         f"GPUs; {len(gpus)} visible ({','.join(gpus)})")
    if sum(ranks) <= len(gpus):  # a GPU per rank for everyone
        starts = [sum(ranks[:i]) for i in range(len(ranks))]
        devices = [gpus[s:s + r] for s, r in zip(starts, ranks)]
    else:  # share: every worker on the first GPUs
        devices = [gpus[:r] for r in ranks]
    per_gpu = Counter(g for d in devices for g in d)
    share = max(per_gpu.values())
    sized = any(flag in worker_args for flag in _SIZING_FLAGS)
    fraction = None if share == 1 or sized else round(DEFAULT_GPU_MEMORY_UTILIZATION / share, 2)
    return GpuPlan(devices, fraction, share > 1)
