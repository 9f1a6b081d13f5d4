"""Integer weights (`IntWeight`) re-laid as GGUF blocks, so the CPU's native quantized
linears (`baton_cpu.quant_linear`, VNNI / AVX2) serve GPTQ, AWQ and compressed-tensors
int4 / int8 checkpoints as they serve GGUF files.

A GGUF block is 32 consecutive inputs of one row with one fp16 scale (Q4_1: and an fp16
offset). An IntWeight fits when its groups are runs of whole blocks (group size, or the
row for one scale per channel, a multiple of 32; no act-order g_idx):
- int4 symmetric (zero 8) -> Q4_0: w = d (q - 8), d the group's scale;
- int4 with zeros -> Q4_1: w = d q + m, m = -d z;
- int8 symmetric (zero 128) -> Q8_0: w = d q, q = code - 128.
The codes are kept exactly; the scales (and Q4_1's offsets) are rounded to fp16, as GGUF
stores them: within fp16's relative error (4.9e-4) of the checkpoint's weights.
"""

from __future__ import annotations

import torch

from baton.engine.quant.formats import IntWeight
from baton_cpu.quant_reference import QK, QuantType


def block_type(w: IntWeight) -> tuple[QuantType | None, str]:
    """The GGUF type `w` re-lays into, or None and why it cannot."""
    n, k = w.shape
    if w.g_idx is not None:
        return None, "act-order (g_idx) groups are not runs of 32 inputs"
    if k % QK or w.group_size % QK:
        return None, f"{k} inputs in groups of {w.group_size} are not whole 32-blocks"
    if w.bits == 8:
        if w.zeros is not None and not bool((w.zeros == 128).all()):
            return None, "asymmetric int8 has no GGUF block"
        return QuantType.Q8_0, ""
    if w.bits == 4:
        return (QuantType.Q4_0, "") if w.zeros is None else (QuantType.Q4_1, "")
    return None, f"int{w.bits} has no GGUF block"


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """(N, nb) float -> (N, nb, 2) uint8, fp16 little-endian."""
    return v.to(torch.float16).contiguous().view(torch.uint8).reshape(*v.shape, 2)


def to_blocks(w: IntWeight, qtype: QuantType) -> torch.Tensor:
    """`w`'s rows as GGUF `qtype` blocks: uint8 (N, K / 32 * block bytes)."""
    n, k = w.shape
    nb = k // QK
    per_block = torch.arange(nb) * QK // w.group_size  # (nb,) each block's group
    d = w.scales[:, per_block]  # (N, nb)
    codes = w.codes.reshape(n, nb, QK)  # (N, nb, 32)
    if qtype == QuantType.Q8_0:
        qs = (codes.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)  # (N, nb, 32)
        return torch.cat([_f16_bytes(d), qs], dim=-1).reshape(n, -1)
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)  # (N, nb, 16): j low, j + 16 high
    if qtype == QuantType.Q4_0:
        return torch.cat([_f16_bytes(d), nibbles], dim=-1).reshape(n, -1)
    d16 = d.to(torch.float16).float()
    m = -d16 * w.zero_points()[:, per_block].float()  # (N, nb)
    return torch.cat([_f16_bytes(d16), _f16_bytes(m), nibbles], dim=-1).reshape(n, -1)
