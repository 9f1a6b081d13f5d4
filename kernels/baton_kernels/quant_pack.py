"""The layouts the integer-weight GEMM (`quant_gemm.int_weight_gemm`) reads, built once at load
from the canonical form (plain torch: no triton needed, any device).

Canonical integer weight (GPTQ, AWQ, compressed-tensors int4 / int8 after unpacking):
``w[n, k] = scales[n, g(k)] * (codes[n, k] - zeros[n, g(k)])``, codes uint8 ``[N, K]`` in
``0 .. 2^bits - 1``, zeros uint8 ``[N, G]`` or None (symmetric: ``2^(bits - 1)``).

Packed codes, int32 ``[K * bits / 32, N]``: the ``32 / bits`` codes of column ``n`` at rows
``k = p * 32 / bits + j`` (``j = 0 .. 32 / bits - 1``) share ``packed[p, n]``, code ``j`` in
bits ``j * bits .. j * bits + bits - 1`` (the lowest first). This is GPTQ's ``qweight``
layout: a tile of the GEMM reads whole int32 words, consecutive columns side by side
(coalesced). K must be a multiple of ``32 / bits`` (8 for int4, 4 for int8).

Scales and zeros keep their logical shape ``[N, G]``; the kernel reads them through their
strides, fastest when ``group_major`` stored them column-major (a group's N values side by
side, as the weight tile's columns are).
"""

from __future__ import annotations

import torch

INT_BITS = (4, 8)


def codes_per_word(bits: int) -> int:
    """Codes one int32 holds: 8 for int4, 4 for int8; ValueError for other widths."""
    if bits not in INT_BITS:
        raise ValueError(f"bits must be one of {INT_BITS}, got {bits}")
    return 32 // bits


def pack_int_weight(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[N, K]`` -> int32 ``[K * bits / 32, N]`` (the layout above). ValueError
    when K is not a multiple of ``32 / bits``, the dtype is not uint8, or a code does not fit
    in `bits` (one read of the codes: a load-time check)."""
    per_word = codes_per_word(bits)
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"codes must be uint8 [N, K], got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    n, k = codes.shape
    if k % per_word:
        raise ValueError(f"K = {k} is not a multiple of {per_word}: int{bits} packs "
                         f"{per_word} codes per int32 along K")
    if codes.numel() and int(codes.max()) >= 1 << bits:
        raise ValueError(f"a code is {int(codes.max())}, above the int{bits} range "
                         f"0..{(1 << bits) - 1}")
    grouped = codes.t().to(torch.int64).reshape(k // per_word, per_word, n)  # (K / P, P, N)
    shifts = torch.arange(per_word, device=codes.device, dtype=torch.int64) * bits
    words = (grouped << shifts[None, :, None]).sum(dim=1)  # (K / P, N), in 0 .. 2^32 - 1
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # two's complement
    return words.to(torch.int32).contiguous()


def unpack_int_weight(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack_int_weight`: int32 ``[K * bits / 32, N]`` -> uint8 ``[N, K]``."""
    per_word = codes_per_word(bits)
    rows, n = packed.shape
    shifts = torch.arange(per_word, device=packed.device, dtype=torch.int64) * bits
    codes = (packed.to(torch.int64)[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return codes.reshape(rows * per_word, n).t().to(torch.uint8).contiguous()


def group_major(t: torch.Tensor) -> torch.Tensor:
    """``t [N, G]`` with the same values and shape, stored column-major (strides (1, N)):
    the layout in which the GEMM reads scales and zeros fastest."""
    return t.t().contiguous().t()
