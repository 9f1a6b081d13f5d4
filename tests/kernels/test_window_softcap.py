"""Sliding-window and soft-capped attention in the Triton kernels (Mistral, Gemma 2/3,
Phi-3-mini-4k on GPUs) against the references, including windows shorter than a query tile
(rows that see none of a tile's keys), split-K chunks wholly before the window, and the
engine's triton backend against the torch backend's `windowed_attention` for a layer spec."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import ON_GPU  # noqa: F401  (sets TRITON_INTERPRET on CPU)
from tests.kernels.paged_utils import assert_close, make_paged_cache

pytest.importorskip("triton")

from baton_kernels import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from tests.kernels.test_paged_attention import make_prefill_inputs  # noqa: E402

SPECS = [(24, None), (None, 5.0), (7, 3.0)]  # (window, softcap)


@pytest.mark.parametrize("window,softcap", SPECS)
def test_decode_window_and_softcap(device, window, softcap):
    seq_lens = [1, 20, 40, 300]
    k_cache, v_cache, tables, lens = make_paged_cache(seq_lens, 2, 64, 16, torch.float32,
                                                      device)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(len(seq_lens), 4, 64, generator=gen).to(device) * 3
    for splits in (1, 4):  # with 4 splits, chunks before the window hold no visible key
        out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125,
                                     num_splits=splits, sliding_window=window,
                                     softcap=softcap)
        ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125,
                                         sliding_window=window, softcap=softcap)
        assert_close(out, ref, torch.float32)
    if window is not None:  # the window changes the answer for sequences longer than it
        full = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125,
                                          softcap=softcap)
        assert not torch.allclose(full[3], ref[3], atol=1e-3)


@pytest.mark.parametrize("window,softcap", SPECS)
def test_prefill_window_and_softcap(device, window, softcap):
    pairs = [(16, 16), (1, 40), (70, 90), (5, 5)]  # chunks straddling the window edge
    query_lens, seq_lens = zip(*pairs)
    inputs = make_prefill_inputs(list(query_lens), list(seq_lens), 4, 2, 64, 16,
                                 torch.float32, device)
    out = paged_prefill_attention(*inputs, 0.125, sliding_window=window, softcap=softcap)
    ref = paged_prefill_attention_ref(*inputs, 0.125, sliding_window=window, softcap=softcap)
    assert_close(out, ref, torch.float32)


def test_triton_backend_runs_windowed_capped_layers_like_the_torch_path(device):
    from baton.engine.attention.base import BatchLayout, LayerAttention
    from baton.engine.attention.torch_backend import TorchAttentionBackend
    from baton.engine.attention.triton_backend import TritonAttentionBackend

    bs, blocks, kvh, h, d = 16, 16, 2, 4, 64
    gen = torch.Generator().manual_seed(7)
    # Two decodes (contexts 40 and 9) then a 30-token chunk over a 20-token context.
    ctx, seq = [40, 9, 20], [41, 10, 50]
    qsl = [0, 1, 2, 32]
    T = qsl[-1]
    tables = torch.tensor([[0, 1, 2, 0], [3, 0, 0, 0], [4, 5, 6, 7]], dtype=torch.int64)
    slots = [tables[0, 40 // bs] * bs + 40 % bs, tables[1, 0] * bs + 9]
    slots += [tables[2, p // bs] * bs + p % bs for p in range(20, 50)]
    layout = BatchLayout(qsl, ctx, seq, 2, tables, torch.tensor(slots, dtype=torch.int64), bs)
    spec = LayerAttention(0.125, sliding_window=12, softcap=4.0)
    outs = []
    for backend in (TorchAttentionBackend(torch.float32), TritonAttentionBackend(torch.float32)):
        torch.manual_seed(0)
        kc = torch.randn(blocks, bs, kvh, d, generator=gen.manual_seed(1)).to(device)
        vc = torch.randn(blocks, bs, kvh, d, generator=gen.manual_seed(2)).to(device)
        q = torch.randn(T, h, d, generator=gen.manual_seed(3)).to(device) * 3
        k = torch.randn(T, kvh, d, generator=gen.manual_seed(4)).to(device)
        v = torch.randn(T, kvh, d, generator=gen.manual_seed(5)).to(device)
        lay = BatchLayout(qsl, ctx, seq, 2, tables.to(device), layout.slot_mapping.to(device),
                          bs)
        outs.append(backend.forward(q, k, v, kc, vc, backend.build_metadata(lay), spec).cpu())
    assert_close(outs[1], outs[0], torch.float32)
