"""Paged decode and prefill attention kernels against the pure-torch references.

Caches are NaN everywhere except the slots a sequence owns, so a read past a sequence's end
(tail of its last block, or an unused block-table column) turns the output NaN and fails.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.kernels.conftest import ON_GPU
from tests.kernels.paged_utils import assert_close, make_paged_cache

pytest.importorskip("triton")

from baton_kernels import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
)

# dtype, head_dim, block_size, num_heads, num_kv_heads: representative combos on CPU (the
# interpreter is slow), the full product on a GPU.
CASES = [
    (torch.float32, 64, 16, 4, 2),
    (torch.float16, 80, 32, 6, 2),
    (torch.bfloat16, 96, 16, 9, 3),
    (torch.float16, 128, 32, 4, 1),
]
if ON_GPU:
    CASES = list(itertools.product((torch.float32, torch.float16, torch.bfloat16),
                                   (64, 80, 96, 128), (16, 32), (8,), (1, 2, 8)))


def ragged_lengths(block_size: int) -> list[int]:
    return [1, block_size - 1, block_size, 3 * block_size + 5]


@pytest.mark.parametrize("dtype,head_dim,block_size,num_heads,num_kv_heads", CASES)
def test_decode_matches_reference(device, dtype, head_dim, block_size, num_heads,
                                  num_kv_heads):
    seq_lens = ragged_lengths(block_size)
    k_cache, v_cache, block_tables, lens = make_paged_cache(
        seq_lens, num_kv_heads, head_dim, block_size, dtype, device)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, lens, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype,block_size", [(torch.float32, 16), (torch.bfloat16, 32)])
def test_decode_split_k_long_context(device, dtype, block_size):
    # One long sequence, one short enough that most of its splits are empty, one mid-size.
    seq_lens = [1100, 5, 600]
    k_cache, v_cache, block_tables, lens = make_paged_cache(
        seq_lens, 2, 64, block_size, dtype, device)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 64, generator=gen).to(dtype).to(device)
    scale = 0.125
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, lens, scale)
    no_split = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale,
                                      num_splits=1)
    split = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale,
                                   num_splits=4)
    auto = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale)
    assert_close(no_split, ref, dtype)
    assert_close(split, ref, dtype)
    assert_close(auto, ref, dtype)
    assert_close(split, no_split, dtype)


def test_decode_chooses_splits_from_context_length(device):
    from baton_kernels.decode_attention import SPLIT_COUNTS, choose_num_splits
    assert choose_num_splits(1, 1, 100, device) == 1
    assert choose_num_splits(1, 1, 4096, device) > 1
    assert choose_num_splits(1, 1, 1 << 20, device) <= 32
    # Always one of the fixed counts, and fewer for bigger batches.
    for batch in (1, 3, 7, 64, 1000):
        assert choose_num_splits(batch, 2, 1 << 17, device) in SPLIT_COUNTS
    assert choose_num_splits(1000, 8, 1 << 17, device) == 1


def make_prefill_inputs(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size,
                        dtype, device, seed=4):
    k_cache, v_cache, block_tables, lens = make_paged_cache(
        seq_lens, num_kv_heads, head_dim, block_size, dtype, device, seed=seed)
    starts = [0] + list(itertools.accumulate(query_lens))
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=gen).to(dtype).to(device)
    return q, k_cache, v_cache, block_tables, query_start_loc, lens


@pytest.mark.parametrize("dtype,head_dim,block_size,num_heads,num_kv_heads", CASES)
def test_prefill_matches_reference(device, dtype, head_dim, block_size, num_heads,
                                   num_kv_heads):
    bs = block_size
    # (query_len, seq_len): full prompt, single token, chunked prefill over a cached prefix,
    # and a prompt spanning several query tiles.
    pairs = [(bs - 1, bs - 1), (1, 1), (bs, 2 * bs + 3), (1, bs), (70, 70 + bs + 1)]
    query_lens, seq_lens = zip(*pairs)
    inputs = make_prefill_inputs(list(query_lens), list(seq_lens), num_heads, num_kv_heads,
                                 head_dim, block_size, dtype, device)
    scale = head_dim ** -0.5
    out = paged_prefill_attention(*inputs, scale)
    ref = paged_prefill_attention_ref(*inputs, scale)
    assert out.shape == inputs[0].shape and out.dtype == dtype
    assert_close(out, ref, dtype)


def test_prefill_single_tokens_match_decode(device):
    # A prefill with query_len 1 per sequence is a decode step.
    seq_lens = [1, 15, 16, 40]
    inputs = make_prefill_inputs([1] * 4, seq_lens, 4, 2, 64, 16, torch.float32, device)
    q, k_cache, v_cache, block_tables, _, lens = inputs
    prefill = paged_prefill_attention(*inputs, 0.125)
    decode = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.125)
    assert_close(prefill, decode, torch.float32)


def test_rejects_bad_arguments(device):
    k_cache, v_cache, block_tables, lens = make_paged_cache(
        [5, 9], 2, 64, 16, torch.float16, device)
    q = torch.zeros(2, 4, 64, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(q.float(), k_cache, v_cache, block_tables, lens, 0.1)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(q[:, :3], k_cache, v_cache, block_tables, lens, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(q[..., :32], k_cache, v_cache, block_tables, lens, 0.1)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(q, k_cache, v_cache, block_tables.long(), lens, 0.1)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(q, k_cache, v_cache, block_tables, lens[:1], 0.1)
    with pytest.raises(ValueError, match="same shape"):
        paged_decode_attention(q, k_cache, v_cache[:, :8], block_tables, lens, 0.1)
    with pytest.raises(ValueError, match="last dimension"):
        wide = torch.zeros(2, 4, 128, dtype=torch.float16, device=device)
        paged_decode_attention(wide[..., ::2], k_cache, v_cache, block_tables, lens, 0.1)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.1, num_splits=0)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(q, k_cache, v_cache, block_tables, qsl[:2], lens, 0.1)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(q, k_cache, v_cache, block_tables, qsl.long(), lens, 0.1)


def test_import_without_triton_fails_only_on_call():
    import subprocess
    import sys
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import baton_kernels, torch\n"
        "try:\n"
        "    baton_kernels.reshape_and_cache(*[torch.zeros(1)] * 5)\n"
        "except ImportError as e:\n"
        "    assert 'pip install triton' in str(e), e\n"
        "    print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.strip() == "ok", result.stderr
