"""One step's modelled time on a simulated device: the larger of the bytes it moves over
the memory bandwidth and the FLOPs it does over the peak, plus a fixed launch cost.

    bytes = the weights (every step reads them once)
          + the KV the step's tokens attend to (each request's context before the step)
          + the KV they write
    FLOPs = 2 x the blocks' parameters x tokens + 2 x the lm_head x rows sampled
          + attention: 4 x layers x heads x head_dim x (query, key) pairs, a prompt
            chunk's queries attending to the context before it and causally to each other

The rows are the batch's real ones (`StepRow`: new tokens, context before, rows sampled; or a
built batch's layout, `layout_seconds`), so decode batches, prefill chunks, verification
chunks and a static batch's padding cost what their shapes say.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from baton.engine.sim.profile import SimProfile


@dataclass(frozen=True)
class StepRow:
    new_tokens: int  # tokens this step computes for the request
    context: int  # tokens of KV it already had
    sampled: int  # logits rows it samples (0 for a prompt chunk that is not the last)


def step_seconds(profile: SimProfile, rows: list[StepRow]) -> float:
    tokens = sum(r.new_tokens for r in rows)
    pairs = sum(r.new_tokens * r.context + r.new_tokens * (r.new_tokens + 1) // 2
                for r in rows)
    return _seconds(profile, tokens, sum(r.context for r in rows), pairs,
                    sum(r.sampled for r in rows))


def layout_seconds(profile: SimProfile, context_lens: Sequence[int],
                   seq_lens: Sequence[int], sampled: int) -> float:
    """`step_seconds` of a built batch: its sequences' contexts before the step and after
    it (`BatchLayout.context_lens` / `seq_lens`), `sampled` logits rows in all."""
    context = np.asarray(context_lens, dtype=np.int64)
    new = np.asarray(seq_lens, dtype=np.int64) - context
    pairs = int((new * context + new * (new + 1) // 2).sum())
    return _seconds(profile, int(new.sum()), int(context.sum()), pairs, sampled)


def work(profile: SimProfile, tokens: int, context: int, pairs: int,
         sampled: int) -> tuple[float, float]:
    """The bytes a step moves and the FLOPs it does: `tokens` computed attending to
    `context` tokens of KV in all, `pairs` (query, key) pairs, `sampled` logits rows."""
    m = profile.model
    kv = m.kv_bytes_per_token
    moved = m.weight_bytes_total + kv * context + kv * tokens
    flops = (2.0 * m.layer_params * tokens + 2.0 * m.head_params * sampled
             + 4.0 * m.num_layers * m.num_heads * m.head_dim * pairs)
    return moved, flops


def _seconds(profile: SimProfile, tokens: int, context: int, pairs: int, sampled: int) -> float:
    if tokens == 0:
        return 0.0
    moved, flops = work(profile, tokens, context, pairs, sampled)
    d = profile.device
    return (max(moved / (d.memory_bandwidth_gbs * 1e9), flops / (d.peak_tflops * 1e12))
            + d.launch_us * 1e-6)
