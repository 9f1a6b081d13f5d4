"""Pure-torch references for the paged KV-cache kernels, written for clarity, not speed.

Cache layout (per layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``i`` of a
sequence lives in physical block ``block_tables[seq, i // block_size]`` at offset
``i % block_size``; a flat slot number is ``block * block_size + offset``.
"""

from __future__ import annotations

import torch


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` stores it: FP8 holds ``x / scale`` saturated to the
    format's largest value; other dtypes hold ``x`` cast."""
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def reshape_and_cache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write ``k[t]``/``v[t]`` into slot ``slot_mapping[t]`` of the caches; negative slots skip."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    for t in range(k.shape[0]):
        slot = int(slot_mapping[t])
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        k_cache[block, offset] = to_cache(k[t], k_cache.dtype, k_scale)
        v_cache[block, offset] = to_cache(v[t], v_cache.dtype, v_scale)


def gather_sequence_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                       seq_len: int, k_scale: float = 1.0, v_scale: float = 1.0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``seq_len`` keys and values of one sequence, each ``[seq_len, KVH, D]``
    (FP8 caches: as float32 times their scales)."""
    block_size = k_cache.shape[1]
    positions = torch.arange(seq_len, device=k_cache.device)
    blocks = block_table.long()[positions // block_size]
    offsets = positions % block_size
    k, v = k_cache[blocks, offsets], v_cache[blocks, offsets]
    if k.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return k.float() * k_scale, v.float() * v_scale
    return k, v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """``q [Q, H, D]``, ``k/v [K, KVH, D]``, ``mask [Q, K]`` (True = may attend) -> ``[Q, H, D]``.

    Computed in fp32; query head ``h`` reads KV head ``h // (H // KVH)``.
    """
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # A query row with no visible key (empty sequence) gives NaN; define it as zero output.
    probs = torch.nan_to_num(probs, nan=0.0)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                               sliding_window: int | None = None, softcap: float | None = None
                               ) -> torch.Tensor:
    """One query token per sequence attending to its ``seq_lens[b]`` cached tokens (the last
    ``sliding_window`` of them when given)."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        seq_len = int(seq_lens[b])
        k, v = gather_sequence_kv(k_cache, v_cache, block_tables[b], seq_len, k_scale,
                                  v_scale)
        mask = torch.ones(1, seq_len, dtype=torch.bool, device=q.device)
        if sliding_window is not None:
            mask[:, :max(0, seq_len - sliding_window)] = False
        out[b] = _attend(q[b:b + 1], k, v, scale, mask, softcap)[0].to(q.dtype)
    return out


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                seq_lens: torch.Tensor, scale: float, k_scale: float = 1.0,
                                v_scale: float = 1.0, sliding_window: int | None = None,
                                softcap: float | None = None) -> torch.Tensor:
    """Causal attention for the last ``query_len`` positions of each sequence.

    Queries of sequence ``b`` are ``q[query_start_loc[b]:query_start_loc[b + 1]]``; they sit at
    positions ``seq_len - query_len ... seq_len - 1`` and their own K/V are already cached.
    """
    out = torch.zeros_like(q)
    for b in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        seq_len = int(seq_lens[b])
        query_len = end - start
        if query_len == 0:
            continue
        k, v = gather_sequence_kv(k_cache, v_cache, block_tables[b], seq_len, k_scale,
                                  v_scale)
        query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        if sliding_window is not None:
            mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
        out[start:end] = _attend(q[start:end], k, v, scale, mask, softcap).to(q.dtype)
    return out
