"""The device-specific side of running the model: a `Platform` prepares the loaded model for
its device, warms up once the KV cache exists, and runs each step's forward — through its fast
decode path when it has one that can run the batch (the C whole-stack step on CPU, CUDA graph
replays), else through the model's torch code.

The model runner picks one platform from the device at start (`make_platform`) and calls it
from the engine thread only; the model's modules know no device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from baton.engine.attention.base import ForwardContext

if TYPE_CHECKING:
    from baton.engine.models.base import CausalLM
    from baton.engine.runner.batch import FlatBatch
    from baton.engine.runner.model_runner import ModelRunner


class FastDecode(Protocol):
    """A platform's path for decode steps: `run(batch)` -> the final hidden states (T, h) of a
    batch for which `can_run(batch)` is True, writing the step's K/V into the cache."""

    def can_run(self, batch: FlatBatch) -> bool: ...

    def run(self, batch: FlatBatch) -> torch.Tensor: ...


class Platform:
    """The base: no preparation, no warm-up, every step through the model's torch code.
    `fast_decode` is set by `warm_up` (tests may swap it)."""

    name = "torch"
    fast_decode: FastDecode | None = None

    def prepare(self, model: CausalLM) -> None:
        """Make the loaded model (weights on the device) ready for this device, in place;
        called once, before the KV cache is sized."""

    def warm_up(self, runner: ModelRunner) -> None:
        """Once the runner's model, attention backend and KV cache exist: build the fast
        decode path and compile what would otherwise compile on a request's time."""

    def describe(self) -> str:
        """For the start-up log line."""
        return f"platform {self.name}, fast decode {'on' if self.fast_decode else 'off'}"

    def forward(self, runner: ModelRunner, batch: FlatBatch, fast: bool = True) -> torch.Tensor:
        """The last hidden states (T, h) of every row of the batch; `fast=False` runs the
        model's own modules even where the fast path could (it computes the base model's
        linears only: a step with LoRA adapter rows)."""
        if fast and self.fast_decode is not None and self.fast_decode.can_run(batch):
            return self.fast_decode.run(batch)
        ctx = ForwardContext(runner.backend, runner.backend.build_metadata(batch.layout),
                             runner.kv_caches)
        return runner.model(batch.input_ids, batch.positions, ctx)  # (T, h)
