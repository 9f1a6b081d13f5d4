"""Decode steps replayed from CUDA graphs.

A small decode batch on a GPU is bound by Python and kernel launches (a Llama layer is a
dozen launches), not by the GPU. At start-up the runner captures the model's forward for an
all-decode batch at each size in `capture_sizes`, over static input buffers; a later decode
step of n sequences copies its inputs into those buffers, pads them up to the next captured
size (padding rows: slot -1 so nothing is written, length 0 so attention reads nothing) and
replays one graph. Mixed and prefill steps, and batches above the largest size, run eagerly.

A replay depends on nothing but those buffers: the block tables are max_model_len wide (stale
columns past a row's length and stale rows past n are never read), each captured size fixes
its attention split count, and the attention kernel cuts each row's live keys into those
splits on the device. So a request preempted, or joining after its KV was pulled from another
pod, changes the buffers' contents only. The backend's `warmup` has compiled every kernel
before capture, so capture only records launches.

`DecodeGraphs(..., use_graphs=False)` keeps the static buffers and the padding but calls the
model instead of replaying: the same inputs reach the same kernels, so this path is testable
on machines without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol, cast

import torch

from baton.engine.attention.base import AttentionBackend, ForwardContext
from baton.engine.runner.batch import FlatBatch

log = logging.getLogger(__name__)


class _GraphBackend(Protocol):
    """What a backend with `supports_cuda_graphs` adds (TritonAttentionBackend)."""

    def decode_metadata(self, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        slot_mapping: torch.Tensor) -> object: ...

MAX_CAPTURE_SIZE = 256


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to min(max_num_seqs, limit) inclusive."""
    top = max(1, min(max_num_seqs, limit))
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 16))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n rows, None when n is above them all."""
    for s in sizes:
        if s >= n:
            return s
    return None


class _Replay:
    """One captured batch size: `replay()` reruns the forward; `output` holds its result."""

    def __init__(self, fn: Callable[[], torch.Tensor], use_graph: bool, pool) -> None:
        self._fn = fn
        self._graph = None
        self.output = fn()  # an eager run first: sizes the allocator's pools
        if use_graph:
            torch.cuda.synchronize()
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph, pool=pool):
                self.output = fn()

    def replay(self) -> torch.Tensor:
        if self._graph is None:
            self.output = self._fn()
        else:
            self._graph.replay()
        return self.output


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], sizes: list[int],
                 max_blocks_per_seq: int, device: torch.device, use_graphs: bool = True
                 ) -> None:
        if use_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.sizes = sorted(set(sizes))
        self.max_blocks = max_blocks_per_seq
        self.use_graphs = use_graphs
        self._model, self._backend, self._kv_caches = model, backend, kv_caches
        top = self.sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(top, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        self.seq_lens = torch.zeros(top, dtype=torch.int32, device=device)
        self._replays: dict[int, _Replay] = {}
        self.replays: Counter[int] = Counter()  # decode steps served, by captured size

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so that smaller graphs reuse its memory pool.
        The static inputs are padding throughout, so capture writes no KV."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        for size in reversed(self.sizes):
            self._replays[size] = _Replay(self._forward_fn(size), self.use_graphs, pool)
        if self.use_graphs:
            torch.cuda.synchronize()
        log.info("captured decode %s for batch sizes %s in %.1f s",
                 "CUDA graphs" if self.use_graphs else "replays (eager)", self.sizes,
                 time.perf_counter() - t0)

    def _forward_fn(self, size: int) -> Callable[[], torch.Tensor]:
        # cast: the runner builds DecodeGraphs only for a backend with supports_cuda_graphs
        backend = cast(_GraphBackend, self._backend)
        meta = backend.decode_metadata(self.block_tables[:size], self.seq_lens[:size],
                                       self.slot_mapping[:size])
        ctx = ForwardContext(self._backend, meta, self._kv_caches)
        ids, pos = self.input_ids[:size], self.positions[:size]
        return lambda: self._model(ids, pos, ctx)

    def can_run(self, batch: FlatBatch) -> bool:
        layout = batch.layout
        return (bool(self._replays) and layout.num_decodes == layout.num_seqs
                and layout.num_seqs <= self.sizes[-1]
                and layout.block_tables.shape[1] <= self.max_blocks)

    def run(self, batch: FlatBatch) -> torch.Tensor:
        """Hidden states (n, h) of an all-decode batch that `can_run`."""
        layout = batch.layout
        n = layout.num_seqs
        size = padded_size(n, self.sizes)
        width = layout.block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(layout.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(layout.block_tables, non_blocking=True)
        lens = torch.tensor(layout.seq_lens, dtype=torch.int32)
        self.seq_lens[:n].copy_(lens, non_blocking=self.seq_lens.is_cuda)
        assert size is not None  # can_run: n is within the largest size
        if size > n:  # padding rows: nothing written, nothing read
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].zero_()
        self.replays[size] += 1
        return self._replays[size].replay()[:n]
