"""A step's sampled tokens and logprob tables back to the host in one copy: `stage` queues
it (on CUDA, non-blocking into pinned memory with an event after it, so a step launched
ahead is read without waiting on the step after it: `runner/ahead.py`), `read_staged` turns
it into token ids and `TokenLogprobs` once it has landed (`sampler.fetch`: both at once)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from baton.engine.logprobs import TokenLogprobs, read_logprobs

if TYPE_CHECKING:
    from baton.engine.sampler import DeviceSample


@dataclass
class Staged:
    """A step's sampled tokens (then the logprob tables, as float64) on their way to the
    host: `host` holds them once `ready` (None: already there) has completed."""

    host: torch.Tensor
    ready: torch.cuda.Event | None
    sample: DeviceSample


def stage(sample: DeviceSample, non_blocking: bool) -> Staged:
    """Queue the copy of `sample`'s tokens and logprob tables to the host: one copy (ids are
    exact as float64). `non_blocking` on CUDA: into pinned memory, an event after it."""
    flat = sample.tokens if sample.logprobs is None else torch.cat(
        [sample.tokens.double(), sample.logprobs.reshape(-1)])
    if not non_blocking or sample.tokens.device.type != "cuda":
        return Staged(flat.cpu(), None, sample)  # waits for the step
    host = flat.to("cpu", non_blocking=True)  # pinned: queued behind the step
    ready = torch.cuda.Event()
    ready.record()
    return Staged(host, ready, sample)


def read_staged(staged: Staged) -> tuple[list[int], list[TokenLogprobs | None]]:
    """The tokens and the logprobs of the rows that asked, once the copy has landed."""
    if staged.ready is not None:
        staged.ready.synchronize()
    sample = staged.sample
    n = sample.tokens.shape[0]
    values = staged.host.tolist()
    tokens = [int(x) for x in values[:n]]
    lps: list[TokenLogprobs | None] = [None] * n
    if sample.logprobs is not None:
        width = sample.logprobs.shape[1]
        for w, (i, k) in enumerate(zip(sample.logprob_rows, sample.logprob_ks)):
            lps[i] = read_logprobs(values[n + w * width:n + (w + 1) * width], tokens[i], k)
    return tokens, lps
