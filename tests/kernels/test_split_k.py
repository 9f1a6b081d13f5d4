"""Split-K decode that follows the live context: each sequence's keys are cut by its own length
(read on the device), not by the block table's width, which inside a CUDA graph is
max_model_len / block_size. A short context in a 128k-wide table spreads over every split.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import ON_GPU  # noqa: F401  (sets TRITON_INTERPRET on CPU)
from tests.kernels.paged_utils import assert_close, make_paged_cache

pytest.importorskip("triton")

from baton_kernels import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from baton_kernels._tiles import NO_WINDOW  # noqa: E402
from baton_kernels.decode_attention import (  # noqa: E402
    SPLIT_COUNTS,
    decode_block_n,
    decode_partials,
    split_range,
)

WIDE_TOKENS = 128 * 1024  # a 128k max_model_len


def widen(block_tables: torch.Tensor, block_size: int, tokens: int = WIDE_TOKENS) -> torch.Tensor:
    """The table as a CUDA graph's static buffer holds it: ``tokens / block_size`` columns,
    the extra ones pointing at the table's last column (a NaN spare block)."""
    width = tokens // block_size
    extra = block_tables[:, -1:].expand(-1, width - block_tables.shape[1])
    return torch.cat((block_tables, extra), dim=1).contiguous()


def test_a_short_context_in_a_128k_table_gives_every_split_work():
    # What a batch-1 decode graph sees at 1k live context with max_model_len 128k. The old
    # partition cut the table's reach (128k tokens) into chunks, so split 0 held all 1000
    # keys and every other split idled.
    for block_n in (64, 128):
        for splits in [s for s in SPLIT_COUNTS if s * block_n <= 1000]:
            ranges = [split_range(1000, NO_WINDOW, i, splits, block_n) for i in range(splits)]
            assert all(end > start for start, end in ranges), (block_n, splits, ranges)
            assert ranges[0][0] == 0 and ranges[-1][1] == 1000
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # no gap, no overlap
    # More splits than 64-key tiles: the first 16 get one tile each, the rest exit early.
    ranges = [split_range(1000, NO_WINDOW, i, 32, 64) for i in range(32)]
    assert sum(end > start for start, end in ranges) == 16


def test_splits_follow_the_window_and_empty_sequences():
    # A 4k window at 100k context: every split inside the window.
    ranges = [split_range(100_000, 4096, i, 16, 64) for i in range(16)]
    assert ranges[0][0] == 100_000 - 4096 and ranges[-1][1] == 100_000
    assert all(end > start for start, end in ranges)
    assert all(split_range(0, NO_WINDOW, i, 8, 64)[1] <= split_range(0, NO_WINDOW, i, 8, 64)[0]
               for i in range(8))  # a padding row: nothing to read


def test_the_kernel_partitions_like_split_range(device):
    # Through the kernel: a split's lse is finite exactly when split_range gives it keys.
    seq_lens = [1000, 70, 0, 300]
    block_size, splits = 16, 8
    k_cache, v_cache, tables, lens = make_paged_cache(seq_lens, 2, 64, block_size,
                                                      torch.float32, device)
    tables = widen(tables, block_size)
    q = torch.randn(4, 4, 64, generator=torch.Generator().manual_seed(1)).to(device)
    _, _, part_lse = decode_partials(q, k_cache, v_cache, tables, lens, 0.125, splits)
    has_keys = torch.isfinite(part_lse.view(4, 4, splits)).cpu()           # (B, H, S)
    block_n = decode_block_n(block_size)
    expected = torch.tensor([[split_range(n, NO_WINDOW, i, splits, block_n)[1]
                              > split_range(n, NO_WINDOW, i, splits, block_n)[0]
                              for i in range(splits)] for n in seq_lens])  # (B, S)
    assert torch.equal(has_keys, expected[:, None, :].expand(-1, 4, -1))
    assert has_keys[0].all()  # the 1000-token sequence keeps every split busy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_and_padding_rows_in_a_wide_table_match_the_reference(device, dtype):
    seq_lens = [1000, 1, 17, 0, 300, 0]  # mixed lengths, zero-length padding rows
    block_size = 16
    k_cache, v_cache, tables, lens = make_paged_cache(seq_lens, 2, 64, block_size, dtype,
                                                      device)
    wide = widen(tables, block_size)
    q = torch.randn(len(seq_lens), 4, 64, generator=torch.Generator().manual_seed(2))
    q = q.to(dtype).to(device)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)
    assert ref[3].abs().max() == 0 and ref[5].abs().max() == 0
    for splits in (None, 1, 4, 32):  # None: chosen from the table's reach, as in a graph
        out = paged_decode_attention(q, k_cache, v_cache, wide, lens, 0.125,
                                     num_splits=splits)
        assert_close(out, ref, dtype)
    # The host-known live length picks the split count outside graphs.
    out = paged_decode_attention(q, k_cache, v_cache, wide, lens, 0.125, max_seq_len=1000)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("window,softcap", [(24, None), (None, 5.0), (300, 3.0)])
def test_wide_table_with_window_and_softcap(device, window, softcap):
    seq_lens = [900, 20, 0, 301]
    k_cache, v_cache, tables, lens = make_paged_cache(seq_lens, 2, 64, 16, torch.float32,
                                                      device)
    q = torch.randn(4, 4, 64, generator=torch.Generator().manual_seed(3)).to(device) * 3
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125,
                                     sliding_window=window, softcap=softcap)
    out = paged_decode_attention(q, k_cache, v_cache, widen(tables, 16), lens, 0.125,
                                 num_splits=8, sliding_window=window, softcap=softcap)
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_wide_table_over_an_fp8_cache(device, cache_dtype):
    from tests.kernels.test_fp8_cache import fp8_cache

    k, v, tables, lens = fp8_cache([700, 5, 0], 2, 32, 16, cache_dtype, device)
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(4)).to(device)
    ref = paged_decode_attention_ref(q.cpu(), k.cpu(), v.cpu(), tables.cpu(), lens.cpu(),
                                     0.2, 0.5, 3.0)
    out = paged_decode_attention(q, k, v, widen(tables, 16), lens, 0.2, num_splits=8,
                                 k_scale=0.5, v_scale=3.0)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
