"""The simulated device's profile beside a real GPU's step times (`gpu_bench engine`).

For each measured decode batch, the step the profile models for the same shape, batch and
contexts (`engine/sim/roofline.py`); then, over the measured batches, the least-squares fit
of the step's device time against the bytes it reads, t = bytes / bandwidth + launch, which
gives the profile's two decode numbers (`memory_bandwidth_gbs`, `launch_us`) from this GPU.
`peak_tflops` is left alone: decode steps at these batches are bound by memory, not compute,
so they say nothing about it.

The device time a row is fitted on is the engine's own (`EngineCore.timing`: CUDA events
around each step launched ahead); a row without it (a synchronous step, whose device time
is only the host's wait) uses its wall time per step, an upper bound.
"""

from __future__ import annotations

from baton.engine.sim.profile import SimModelShape, SimProfile, load_profile
from baton.engine.sim.roofline import StepRow, step_seconds


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


def step_bytes(profile: SimProfile, batch: int, contexts: list[int]) -> float:
    """Mean bytes a decode step reads and writes: the weights, the KV attended, the KV written."""
    m = profile.model
    mean_context = sum(contexts) / len(contexts)
    return m.weight_bytes_total + m.kv_bytes_per_token * batch * (mean_context + 1)


def fit(points: list[tuple[float, float]]) -> dict | None:
    """Least squares of device ms against bytes over (bytes, ms) points: the bandwidth and
    the fixed cost per step they imply, or None without two distinct sizes or with a fit
    that is not physical (bandwidth <= 0)."""
    if len({b for b, _ in points}) < 2:
        return None
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    var = sum((b - mean_b) ** 2 for b, _ in points)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / var  # ms per byte
    if slope <= 0:
        return None
    launch_ms = mean_t - slope * mean_b
    residual = max(abs(t - (slope * b + launch_ms)) / t for b, t in points)
    return {"memory_bandwidth_gbs": round(1e-6 / slope, 1),
            "launch_us": round(max(0.0, 1e3 * launch_ms), 1),
            "max_relative_residual": round(residual, 3), "points": n}


def calibrate(profile: SimProfile, rows: list[dict]) -> dict:
    """The report: the profile as it stands, each row's measured over modelled step, and the
    fit. `rows` are `gpu_bench` engine rows carrying `batch`, `sim_bytes`, `device_ms` (or
    None) and `step_ms_mean`; a batch measured in both modes counts once, by its lower time."""
    by_batch: dict[int, tuple[float, float]] = {}
    for r in rows:
        if "sim_bytes" not in r:
            continue
        ms = r.get("device_ms") or r["step_ms_mean"]
        if r["batch"] not in by_batch or ms < by_batch[r["batch"]][1]:
            by_batch[r["batch"]] = (r["sim_bytes"], ms)  # the tightest of a batch's rows
    points = list(by_batch.values())
    d = profile.device
    return {"profile": profile.name,
            "profile_device": {"memory_bandwidth_gbs": d.memory_bandwidth_gbs,
                               "peak_tflops": d.peak_tflops, "launch_us": d.launch_us},
            "fit": fit(points)}
