"""Decode replays (the CUDA-graph path: static buffers max_model_len wide, padded rows) give
what an eager step gives while the batch changes under them: a request preempted (its blocks
freed and handed to another), a request whose KV was pulled from elsewhere joining with a
long context, the batch shrinking to one. On CPU the replays run eagerly over the same static
buffers (`use_graphs=False`) with the kernels in Triton's interpreter; on a GPU they are real
CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import ON_GPU

pytest.importorskip("triton")

from baton.engine.attention.base import BatchLayout, ForwardContext  # noqa: E402
from baton.engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from baton.engine.runner.batch import FlatBatch  # noqa: E402
from baton.engine.runner.cuda_graphs import DecodeGraphs  # noqa: E402

H, KVH, D, BS = 4, 2, 32, 16
MAX_MODEL_LEN = 2048
NUM_BLOCKS = 96


class OneAttentionLayer(torch.nn.Module):
    """A model reduced to its attention: q, k, v from a table by token id and position, as
    views of one fused projection (T, (H + 2 KVH) D)."""

    def __init__(self, device):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.table = torch.randn(64, (H + 2 * KVH) * D, generator=gen).to(device)

    def forward(self, input_ids, positions, ctx):
        T = input_ids.shape[0]
        qkv = self.table[input_ids % 64] + 0.001 * positions[:, None]      # (T, (H+2KVH)D)
        q = qkv[:, :H * D].view(T, H, D)
        k = qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
        v = qkv[:, (H + KVH) * D:].view(T, KVH, D)
        return ctx.attention(0, q, k, v).reshape(T, H * D)                 # (T, H D)


def decode_batch(seqs: dict[str, tuple[int, list[int]]], device) -> FlatBatch:
    """One decode token per sequence: name -> (cached tokens, its blocks)."""
    ctx = [c for c, _ in seqs.values()]
    width = max(len(b) for _, b in seqs.values())
    tables = torch.tensor([b + [0] * (width - len(b)) for _, b in seqs.values()])
    slots = [b[c // BS] * BS + c % BS for c, b in seqs.values()]
    n = len(seqs)
    layout = BatchLayout(list(range(n + 1)), ctx, [c + 1 for c in ctx], n, tables.to(device),
                         torch.tensor(slots, dtype=torch.int64).to(device), BS)
    ids = torch.tensor([7 * i + 3 for i in range(n)], device=device)
    return FlatBatch(ids, torch.tensor(ctx, device=device), layout, [], [], [])


def test_replays_match_eager_steps_through_preemption_and_pulls():
    device = torch.device("cuda" if ON_GPU else "cpu")
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(2, NUM_BLOCKS, BS, KVH, D, generator=gen).to(device)
    caches = [(kv[0], kv[1])]
    model = OneAttentionLayer(device)
    backend = TritonAttentionBackend(torch.float32)
    graphs = DecodeGraphs(model, backend, caches, [1, 2, 4], MAX_MODEL_LEN // BS, device,
                          use_graphs=ON_GPU)
    graphs.capture()

    def check(seqs):
        batch = decode_batch(seqs, device)
        assert graphs.can_run(batch)
        replayed = graphs.run(batch).clone()
        meta = backend.build_metadata(batch.layout)  # eager: same token, same slots
        eager = model(batch.input_ids, batch.positions, ForwardContext(backend, meta, caches))
        torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)
        return replayed

    a, b, c = (40, [0, 1, 2]), (300, list(range(3, 22))), (5, [22])
    first = check({"a": a, "b": b, "c": c})          # 3 rows padded to 4
    # b is preempted: its blocks go to d, whose 500 tokens were pulled in (written to the
    # cache outside any step, as a KV transfer does) and which joins the batch.
    d = (500, b[1][::-1] + list(range(23, 36)))     # 32 blocks, b's 19 among them
    kv[:, torch.tensor(d[1])] = torch.randn(2, 32, BS, KVH, D, generator=gen).to(device)
    second = check({"d": d, "a": (41, a[1]), "c": (6, c[1])})
    assert not torch.allclose(second[0], first[1])  # d is not b
    check({"d": (501, d[1])})                        # one row: size 1, rows 1..3 stale
    check({"a": (42, a[1]), "c": (7, c[1])})          # back to size 2, d's rows stale
    assert dict(graphs.replays) == {4: 2, 1: 1, 2: 1}
