"""Triton kernels for the paged KV cache (cache writes, decode and prefill attention) and
the quantized-weight GEMMs (W4A16 / W8A16 integer weights, FP8 weights).

The kernels need ``triton`` (``pip install triton==3.7.1``); importing this package does not.
On CPU they run only in triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
imported). The pure-torch references in ``baton_kernels.reference`` and
``baton_kernels.quant_reference``, and the weight packing (``quant_pack``), always work.

Every kernel compiles to a small, fixed set of variants per model (shapes, dtypes, soft-cap
or not): nothing that changes from step to step (batch size, lengths, split count, a table's
width) picks a variant. ``warmup`` launches them all once at start, so no request pays a JIT;
``recording_variants`` collects the variant keys of the launches in a block (tests).
"""

from __future__ import annotations

import importlib

from baton_kernels.quant_pack import group_major, pack_int_weight
from baton_kernels.reference import (
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    reshape_and_cache_ref,
)

__all__ = [
    "reshape_and_cache", "paged_decode_attention", "paged_prefill_attention", "warmup",
    "recording_variants", "reshape_and_cache_ref", "paged_decode_attention_ref",
    "paged_prefill_attention_ref", "int_weight_gemm", "fp8_weight_gemm", "pack_int_weight",
    "group_major",
]


def _load(module: str):
    try:
        importlib.import_module("triton")
    except ImportError as exc:
        raise ImportError("baton_kernels needs triton to run its kernels: "
                          "pip install triton==3.7.1 (or use the pure-torch references in "
                          "baton_kernels.reference)") from exc
    return importlib.import_module(f"baton_kernels.{module}")


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    """Scatter ``k/v [T, KVH, D]`` into the paged caches at ``slot_mapping`` (FP8 caches:
    quantised by the scales); see cache_ops."""
    return _load("cache_ops").reshape_and_cache(k, v, k_cache, v_cache, slot_mapping,
                                                k_scale, v_scale)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, *,
                           num_splits=None, max_seq_len=None, k_scale=1.0, v_scale=1.0,
                           sliding_window=None, softcap=None):
    """Decode attention (one query token per sequence, split-K over each sequence's live
    keys); see decode_attention."""
    return _load("decode_attention").paged_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=num_splits,
        max_seq_len=max_seq_len, k_scale=k_scale, v_scale=v_scale,
        sliding_window=sliding_window, softcap=softcap)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                            scale, *, k_scale=1.0, v_scale=1.0, sliding_window=None,
                            softcap=None):
    """Causal prefill attention over cached prefixes; see prefill_attention."""
    return _load("prefill_attention").paged_prefill_attention(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
        k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window, softcap=softcap)


def int_weight_gemm(x, packed, scales, zeros, g_idx, group_size, bits, n, k):
    """W4A16 / W8A16: ``x @ w.T`` with w packed by `pack_int_weight`; see quant_gemm."""
    return _load("quant_gemm").int_weight_gemm(x, packed, scales, zeros, g_idx, group_size,
                                               bits, n, k)


def fp8_weight_gemm(x, w, w_scale, block=None, input_scale=None):
    """``x @ w.T`` with a float8_e4m3fn weight and its scales, on CUDA; see fp8_gemm."""
    return _load("fp8_gemm").fp8_weight_gemm(x, w, w_scale, block, input_scale)


def warmup(dtype, k_cache, v_cache, num_heads, softcaps=(None,)) -> None:
    """Launch every kernel variant a model's engine can use, once, before serving (compiles
    them on CUDA; reads the cache, writes nothing); see _warmup.py."""
    return _load("_warmup").warmup(dtype, k_cache, v_cache, num_heads, softcaps)


def recording_variants():
    """A context manager yielding the set of variant keys launched inside it; see
    _variants.py."""
    return _load("_variants").recording_variants()
