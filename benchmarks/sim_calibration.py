"""The simulated device's profile beside a real GPU's step times (`gpu_bench engine`).

For each measured decode batch, the step the profile models for the same shape, batch and
contexts (`engine/sim/roofline.py`); then, over the measured batches, the roofline fitted to
the steps' device times, t = max(bytes / bandwidth, FLOPs / peak) + launch, which gives the
profile's device numbers (`memory_bandwidth_gbs`, `peak_tflops`, `launch_us`) from this GPU.
A decode step at a small batch is bound by reading the weights; at a few hundred rows an 8B
model's is near the compute ridge (on an H200, batch 256 was bound by compute), so the fit
tries each split of the steps into memory-bound and compute-bound. `peak_tflops` comes back
only when some step is bound by compute.

The device time a row is fitted on is the engine's own (`EngineCore.timing`: CUDA events
around each step launched ahead); a row without it (a synchronous step, whose device time
is only the host's wait) uses its wall time per step, an upper bound.
"""

from __future__ import annotations

import numpy as np

from baton.engine.sim.profile import SimModelShape, SimProfile, load_profile
from baton.engine.sim.roofline import StepRow, step_seconds, work


def profile_for(device_name: str) -> SimProfile:
    """The bundled profile of this GPU's kind: H200 by name, else the H100's."""
    return load_profile("h200-llama3-8b" if "H200" in device_name.upper() else "h100-llama3-8b")


def with_shape(profile: SimProfile, shape, weight_bytes: float, kv_bytes: float) -> SimProfile:
    """`profile`'s device serving the benchmark's model shape (`gpu_bench.ModelShape`)."""
    model = SimModelShape(
        name="gpu_bench", num_layers=shape.layers, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, vocab_size=shape.vocab_size,
        weight_bytes=weight_bytes, kv_bytes=kv_bytes)
    return SimProfile(profile.name, profile.device, model)


def decode_contexts(prompt_len: int, first_step: int, steps: int) -> list[int]:
    """The context before each timed decode step: decode step j (from 1) attends to
    prompt_len + j - 1 tokens; the timed ones start at `first_step`."""
    return [prompt_len + first_step - 1 + k for k in range(steps)]


def modelled_ms(profile: SimProfile, batch: int, contexts: list[int]) -> float:
    """The profile's mean step time (ms) over decode steps of `batch` rows at `contexts`."""
    total = sum(step_seconds(profile, [StepRow(1, c, 1)] * batch) for c in contexts)
    return 1e3 * total / len(contexts)


def step_work(profile: SimProfile, batch: int, contexts: list[int]) -> tuple[float, float]:
    """Mean bytes a decode step of `batch` rows moves (the weights, the KV attended, the KV
    written) and FLOPs it does, over steps at `contexts` (`roofline.work`)."""
    works = [work(profile, batch, batch * c, batch * (c + 1), batch) for c in contexts]
    return (sum(b for b, _ in works) / len(works), sum(f for _, f in works) / len(works))


def fit(points: list[tuple[float, float, float]]) -> dict | None:
    """The roofline t = max(bytes / bandwidth, FLOPs / peak) + launch fitted to measured
    (bytes, FLOPs, ms) steps: least squares of the relative error, each split of the points
    (by arithmetic intensity) into memory-bound and compute-bound tried, the launch cost >= 0.
    A split whose fit bounds a point by the other term is left out, and so is a fit that is
    not physical (a rate <= 0). `peak_tflops` is None when no point is bound by compute (the
    steps say nothing of it). None without two distinct points or any physical fit."""
    if len(set(points)) < 2:
        return None
    pts = sorted(points, key=lambda p: p[1] / p[0])
    best: tuple[float, tuple[float, float, float], int] | None = None
    for memory_bound in range(1, len(pts) + 1):
        solved = _solve_split(pts, memory_bound)
        if solved is None:
            continue
        errors = _relative_errors(pts, *solved)
        err = sum(e * e for e in errors)
        if best is None or err < best[0]:
            best = (err, solved, len(pts) - memory_bound)
    if best is None:
        return None
    _, (x, y, launch), compute_bound = best
    residual = max(map(abs, _relative_errors(pts, x, y, launch)))
    return {"memory_bandwidth_gbs": round(float(1e-6 / x), 1),
            "peak_tflops": round(float(1e-9 / y), 1) if compute_bound else None,
            "launch_us": round(float(1e3 * launch), 1),
            "max_relative_residual": round(float(residual), 3), "points": len(pts),
            "compute_bound_points": compute_bound}


def _relative_errors(pts: list[tuple[float, float, float]], x: float, y: float,
                     launch: float) -> list[float]:
    """Each point's modelled time, max(bytes x, FLOPs y) + launch, over its measured, less 1."""
    return [(max(b * x, f * y) + launch - t) / t for b, f, t in pts]


def _solve_split(pts: list[tuple[float, float, float]],
                 memory_bound: int) -> tuple[float, float, float] | None:
    """(ms per byte, ms per FLOP, launch ms) with the first `memory_bound` points bound by
    memory and the rest by compute, each equation divided by its time (relative error); the
    launch cost is dropped (0) where it would be negative or the points cannot fix it."""
    compute = len(pts) > memory_bound
    rows = [[b, 0.0, 1.0] if i < memory_bound else [0.0, f, 1.0]
            for i, (b, f, _) in enumerate(pts)]
    a = np.array(rows) / np.array([t for _, _, t in pts])[:, None]
    cols = [0, 1, 2] if compute else [0, 2]
    sol = _lstsq(a[:, cols])
    if sol is None or sol[-1] < 0:
        cols = cols[:-1]
        sol = _lstsq(a[:, cols])
    if sol is None:
        return None
    full = dict(zip(cols, sol))
    x, y, launch = full.get(0, 0.0), full.get(1, 0.0), full.get(2, 0.0)
    if x <= 0 or (compute and y <= 0):
        return None
    slack = 1e-9
    for i, (b, f, _) in enumerate(pts):
        if (b * x < f * y * (1 - slack)) if i < memory_bound else (f * y < b * x * (1 - slack)):
            return None  # the fit bounds this point by the other term
    return x, y, launch


def _lstsq(a: np.ndarray) -> np.ndarray | None:
    """Least squares of a @ v = 1, or None where the columns do not fix v."""
    if a.shape[0] < a.shape[1] or np.linalg.matrix_rank(a) < a.shape[1]:
        return None
    return np.linalg.lstsq(a, np.ones(a.shape[0]), rcond=None)[0]


def calibrate(profile: SimProfile, rows: list[dict]) -> dict:
    """The report: the profile as it stands, each row's measured over modelled step, and the
    fit. `rows` are `gpu_bench` engine rows carrying `batch`, `sim_bytes`, `sim_flops`,
    `device_ms` (or None) and `step_ms_mean`; a batch measured in both modes counts once, by
    its lower time."""
    by_batch: dict[int, tuple[float, float, float]] = {}
    for r in rows:
        if "sim_bytes" not in r:
            continue
        ms = r.get("device_ms") or r["step_ms_mean"]
        if r["batch"] not in by_batch or ms < by_batch[r["batch"]][2]:
            by_batch[r["batch"]] = (r["sim_bytes"], r["sim_flops"], ms)  # the tightest
    d = profile.device
    return {"profile": profile.name,
            "profile_device": {"memory_bandwidth_gbs": d.memory_bandwidth_gbs,
                               "peak_tflops": d.peak_tflops, "launch_us": d.launch_us},
            "fit": fit(list(by_batch.values()))}
