"""`baton profile`: time real engine steps on this machine and fit the cost models.

The engine is driven through its public API (`EngineCore.make_request / add / step`) with
random prompt tokens and prefix caching off, so every timed step does the full work:

- prefill: one request of N prompt tokens and max_tokens=1; its single step is timed
  (N never exceeds max_num_batched_tokens, so it is one step), `repeats` times.
- decode: B requests of C prompt tokens are prefilled (untimed), then `decode_steps` pure
  decode steps of all B sequences are timed, at the mean summed context of those steps.

A prefill point keeps the fastest of its repeats: other work on the machine only ever adds
time, and the profile should describe a pod that has its device to itself (a prefill step is
long, its repeats on an idle machine agree within a few percent). A decode point keeps the
median of its steps: decode steps are short and spread even on an idle core (the fastest of
five was 5-10% below the typical one here, fp32 on one core), and what the planner predicts
is a percentile over thousands of such steps, so the typical step is the one to price; the
median still ignores a step that something else interrupted. A step's time includes
scheduling, sampling and (decode) incremental detokenisation, as a served request sees it.
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from baton.planner.profile import (
    DecodePoint,
    EngineLimits,
    Hardware,
    PrefillPoint,
    Profile,
    fit_decode,
    fit_prefill,
)

log = logging.getLogger(__name__)

PREFILL_TOKENS = (128, 256, 512, 1024, 2048)
QUICK_PREFILL_TOKENS = (64, 128, 256, 512)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
QUICK_DECODE_BATCHES = (1, 2, 4, 8, 16)
DECODE_CONTEXTS = (128, 1024, 4096)
QUICK_DECODE_CONTEXTS = (64, 256)


@dataclass(frozen=True)
class ProfileSettings:
    """What to measure. `max_batch` / `max_context` bound the decode grid (the largest
    point holds max_batch x max_context tokens of KV); `quick` takes a small grid."""

    model: str | None = None
    dtype: str = "bfloat16"
    device: str = "auto"
    sim_profile: str | None = None  # --device sim: the simulated GPU x model (engine.sim)
    max_batch: int = 64
    max_context: int = 4096
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    num_threads: int | None = None
    quick: bool = False
    repeats: int = 3
    decode_steps: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_num_batched_tokens", "max_num_seqs", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"ProfileSettings.{name}={getattr(self, name)} must be >= 1")
        if self.max_context < 16:
            raise ValueError(f"ProfileSettings.max_context={self.max_context} must be >= 16")
        if self.decode_steps < 2:
            raise ValueError(f"ProfileSettings.decode_steps={self.decode_steps} must be >= 2")


@dataclass(frozen=True)
class Grid:
    prefill_tokens: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]

    @classmethod
    def build(cls, s: ProfileSettings, max_model_len: int) -> Grid:
        prefill_cap = min(s.max_num_batched_tokens, max_model_len - 1)
        ctx_cap = min(s.max_context, max_model_len - s.decode_steps - 2)
        batches = QUICK_DECODE_BATCHES if s.quick else DECODE_BATCHES
        grid = cls(_capped(QUICK_PREFILL_TOKENS if s.quick else PREFILL_TOKENS, prefill_cap),
                   _capped(batches, s.max_batch),
                   _capped(QUICK_DECODE_CONTEXTS if s.quick else DECODE_CONTEXTS, ctx_cap))
        if len(grid.prefill_tokens) < 2:
            raise ValueError(f"ProfileSettings.max_num_batched_tokens={s.max_num_batched_tokens}"
                             " leaves fewer than 2 prefill sizes to fit; raise it")
        if len(grid.decode_batches) < 2 or len(grid.decode_contexts) < 1:
            raise ValueError(f"ProfileSettings.max_batch={s.max_batch} leaves fewer than 2 "
                             "decode batch sizes to fit; raise it")
        return grid

    @property
    def num_points(self) -> int:
        return len(self.prefill_tokens) + len(self.decode_batches) * len(self.decode_contexts)


def _capped(values: tuple[int, ...], cap: int) -> tuple[int, ...]:
    return tuple(sorted({min(v, cap) for v in values if v > 0}))


class Profiler:
    """Owns one engine sized for the grid and times steps on it (one thread)."""

    def __init__(self, settings: ProfileSettings) -> None:
        from baton.engine.config import EngineConfig
        from baton.engine.core import EngineCore
        from baton.engine.models.config import ModelConfig
        from baton.engine.models.loader import resolve_model_dir

        self.settings = settings
        max_len = ModelConfig.from_dir(resolve_model_dir(settings.model)).max_position_embeddings
        self.grid = Grid.build(settings, max_len)
        block = 16
        per_seq = -(-(max(self.grid.decode_contexts) + settings.decode_steps + 2) // block)
        blocks = max(self.grid.decode_batches) * per_seq + max(self.grid.prefill_tokens) // block
        self.engine = EngineCore(EngineConfig.from_args(
            model=settings.model, dtype=settings.dtype, device=settings.device,
            sim_profile=settings.sim_profile, block_size=block, max_num_batched_tokens=settings.max_num_batched_tokens,
            max_num_seqs=max(settings.max_num_seqs, max(self.grid.decode_batches)),
            enable_prefix_caching=False, num_kv_blocks=blocks + 8,
            num_threads=settings.num_threads,
            async_scheduling=False))  # each timed step read before the next (`_timed_step`)
        self._rng = np.random.default_rng(settings.seed)
        self._count = 0

    def _request(self, num_tokens: int, max_tokens: int, detokenize: bool = False):
        from baton.common.sampling_params import SamplingParams

        self._count += 1
        # Skip the lowest ids (special tokens) so that no prompt holds a stop token.
        ids = self._rng.integers(256, self.engine.model_config.vocab_size, size=num_tokens)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        req = self.engine.make_request(f"profile-{self._count}", ids.tolist(), params,
                                       detokenize=detokenize)
        self.engine.add(req)
        return req

    def _timed_step(self) -> float:
        t0 = time.perf_counter()
        self.engine.step()  # returns sampled ids as Python ints: the device has synced
        return time.perf_counter() - t0

    def prefill_point(self, tokens: int) -> PrefillPoint:
        times = []
        for _ in range(self.settings.repeats):
            self._request(tokens, max_tokens=1)
            times.append(self._timed_step())
            self._drain()
        return PrefillPoint(tokens, min(times))

    def decode_point(self, batch: int, ctx: int) -> DecodePoint:
        steps = self.settings.decode_steps
        reqs = [self._request(ctx, max_tokens=steps + 2, detokenize=True)
                for _ in range(batch)]
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
            self.engine.step()  # the prompts' prefill, untimed
        times, totals = [], []
        for _ in range(steps):
            totals.append(sum(r.num_computed_tokens + 1 for r in reqs))
            times.append(self._timed_step())
        self.engine.abort_requests([r.request_id for r in reqs])
        self._drain()
        return DecodePoint(batch, ctx, round(statistics.mean(totals)), statistics.median(times))

    def _drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def warm_up(self) -> None:
        """One untimed prefill and a few decode steps: first calls pay one-off costs."""
        self.prefill_point(min(self.grid.prefill_tokens))
        self.decode_point(min(self.grid.decode_batches), min(self.grid.decode_contexts))

    def limits(self) -> EngineLimits:
        return EngineLimits(self.settings.max_num_batched_tokens, self.settings.max_num_seqs,
                            self.engine.max_model_len, self.engine.config.cache.block_size)

    def hardware(self) -> Hardware:
        import torch

        from baton.engine.sim.runner import SimRunner

        runner = self.engine.runner
        if isinstance(runner, SimRunner):  # the steps' times are the profile's model
            return Hardware("sim", _cpu_name(), f"{runner.profile.device.name} (simulated)",
                            str(torch.__version__), torch.get_num_threads())
        device = runner.device
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        return Hardware(device.type, _cpu_name(), gpu, str(torch.__version__),
                        torch.get_num_threads())


def run_profile(settings: ProfileSettings, progress: bool = True) -> Profile:
    """Measure the grid on a fresh engine and fit both cost models."""
    from tqdm import tqdm

    profiler = Profiler(settings)
    grid = profiler.grid
    bar = tqdm(total=grid.num_points, desc="profiling", unit="point", disable=not progress)
    try:
        profiler.warm_up()
        prefill = []
        for n in grid.prefill_tokens:
            bar.set_postfix_str(f"prefill {n} tokens")
            prefill.append(profiler.prefill_point(n))
            bar.update(1)
        decode = []
        for ctx in grid.decode_contexts:
            for batch in grid.decode_batches:
                bar.set_postfix_str(f"decode batch {batch} x ctx {ctx}")
                decode.append(profiler.decode_point(batch, ctx))
                bar.update(1)
    finally:
        bar.close()
        profiler.engine.close()
    from baton.engine.sim.profile import load_profile

    model = (load_profile(settings.sim_profile).model.name if settings.sim_profile
             else model_name(settings.model))
    return Profile(model=model, dtype=settings.dtype,
                   hardware=profiler.hardware(), limits=profiler.limits(),
                   prefill=fit_prefill(prefill), decode=fit_decode(decode))


def model_name(model: str | None) -> str:
    if model is None:
        from baton.engine.models.loader import BUNDLED_NAME

        return BUNDLED_NAME
    return Path(model).name.removesuffix(".gguf")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"
