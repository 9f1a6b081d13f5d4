"""Helpers for kernel tests: NaN-guarded paged caches with shuffled physical blocks."""

from __future__ import annotations

import torch

TOLERANCES = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_paged_cache(seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                     dtype: torch.dtype, device: torch.device, *, spare_blocks: int = 3,
                     seed: int = 0):
    """Caches where only the first ``seq_lens[b]`` slots of each sequence hold data.

    Physical blocks are a random permutation; every other slot (spare blocks, the tail of each
    sequence's last block) is NaN, and block-table columns past a sequence's last block point
    at a NaN spare block, so any out-of-bounds read poisons the output.
    Returns ``k_cache, v_cache, block_tables (int32), seq_lens (int32)``.
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(seq_lens), max(needed) + 1), int(perm[-1]), dtype=torch.int32)
    used = 0
    for b, (seq_len, n) in enumerate(zip(seq_lens, needed)):
        block_tables[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
        pos = torch.arange(seq_len)
        blocks = block_tables[b].long()[pos // block_size]
        k_cache[blocks, pos % block_size] = torch.randn(
            seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v_cache[blocks, pos % block_size] = torch.randn(
            seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
    return (k_cache.to(device), v_cache.to(device), block_tables.to(device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(actual).any(), "kernel output contains NaN (out-of-bounds read?)"
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)
