"""GGUF's block formats in plain torch, the reference `csrc/linear_q.c` is tested against.

A tensor of N rows of K elements is stored as N x K / 32 blocks, row-major (as in the file
and `gguf.GGUFReader`'s `data`, uint8 (N, K / 32 * block bytes)):

- Q8_0 (34 bytes): fp16 d, 32 x int8 q; w = d * q.
- Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles; w = d * (q - 8).
- Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m.

Nibble byte i holds element i in its low half and element i + 16 in its high half.

The "K" formats group 256 elements in a super-block (`csrc/linear_qk.h` spells the bytes out):

- Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks
  of 32, 128 bytes of nibbles; w = d * sc * q - dmin * mn.
- Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per
  16 elements), fp16 d; w = d * sc * (q - 32).

`quantize_k` writes those two from float weights with the formats' published math (one
pass: scales from each sub-block's range, then rounding; llama.cpp's quantizer also searches
each sub-block's scale, so its error is a little lower). The `gguf` package de-quantizes
K types but cannot quantize them.
"""

from __future__ import annotations

from enum import IntEnum

import torch

QK = 32  # elements per block
QK_K = 256  # elements per K super-block


class QuantType(IntEnum):
    """The GGML type ids (`gguf.GGMLQuantizationType`) of the formats served natively."""

    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    Q4_K = 12
    Q6_K = 14

    @property
    def block_bytes(self) -> int:
        return {QuantType.Q4_0: 18, QuantType.Q4_1: 20, QuantType.Q8_0: 34,
                QuantType.Q4_K: 144, QuantType.Q6_K: 210}[self]

    @property
    def block_elems(self) -> int:
        return QK_K if self in (QuantType.Q4_K, QuantType.Q6_K) else QK


def dequantize(raw: torch.Tensor, qtype: QuantType, k: int) -> torch.Tensor:
    """raw uint8 (N, k / block elems * block bytes) -> float32 (N, k)."""
    n = raw.shape[0]
    if qtype in (QuantType.Q4_K, QuantType.Q6_K):
        blocks = raw.reshape(n * k // QK_K, qtype.block_bytes)  # (N nb, bytes)
        w = _dequantize_q4_k(blocks) if qtype == QuantType.Q4_K else _dequantize_q6_k(blocks)
        return w.reshape(n, k)
    blocks = raw.reshape(n, k // QK, qtype.block_bytes)  # (N, nb, bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # (N, nb, 1)
    if qtype == QuantType.Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()  # (N, nb, 32)
        return (d * q).reshape(n, k)
    nibbles = blocks[..., -16:]  # (N, nb, 16)
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()  # (N, nb, 32)
    if qtype == QuantType.Q4_0:
        return (d * (q - 8)).reshape(n, k)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()  # (N, nb, 1)
    return (d * q + m).reshape(n, k)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) -> the float32 values the kernel's int8 activations stand for: per 32-block
    d = amax / 127, q = round(x / d) (half to even), value d * q."""
    M, K = x.shape
    xb = x.float().reshape(M, K // QK, QK)  # (M, nb, 32)
    d = xb.abs().amax(dim=-1, keepdim=True) / 127  # (M, nb, 1)
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    return (torch.round(xb * inv) * d).reshape(M, K)


def reference_linear(x: torch.Tensor, raw: torch.Tensor, qtype: QuantType,
                     bias: torch.Tensor | None = None,
                     quantized_x: bool = True) -> torch.Tensor:
    """y (M, N) float32 = x @ dequantize(raw).T (+ bias), the activations quantized as the
    kernel quantizes them (`quantized_x`) or kept as they are."""
    w = dequantize(raw, qtype, x.shape[1])  # (N, K)
    xs = quantize_activations(x) if quantized_x else x.float()
    y = xs @ w.T
    return y if bias is None else y + bias.float()


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes (B, 12) -> the 8 sub-blocks' 6-bit scales and mins, int (B, 8) each."""
    s = s.long()
    a, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]  # (B, 4)
    sc = torch.cat([a & 63, (md & 0x0F) | ((a >> 6) << 4)], dim=1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 6) << 4)], dim=1)
    return sc, mn


def _dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    """(B, 144) -> (B, 256) float32."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # (B, 1)
    sc, mn = _scale_min_k4(b[:, 4:16])  # (B, 8)
    qs = b[:, 16:].long().reshape(-1, 4, 1, 32)  # (B, pair, 1, 32)
    q = ((qs >> torch.tensor([0, 4]).view(1, 1, 2, 1)) & 0x0F).reshape(-1, 8, 32)  # (B, 8, 32)
    w = (d * sc).unsqueeze(-1) * q - (dmin * mn).unsqueeze(-1)  # (B, 8, 32)
    return w.reshape(-1, QK_K)


def _dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    """(B, 210) -> (B, 256) float32."""
    ql = b[:, :128].long().reshape(-1, 2, 1, 64)  # (B, half, 1, 64)
    qh = b[:, 128:192].long().reshape(-1, 2, 1, 32)  # (B, half, 1, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float()  # (B, 16)
    d = _f16(b[:, 208:210])  # (B, 1)
    lo = ((ql >> torch.tensor([0, 4]).view(1, 1, 2, 1)) & 0x0F).reshape(-1, 2, 4, 32)
    hi = ((qh >> torch.tensor([0, 2, 4, 6]).view(1, 1, 4, 1)) & 3).reshape(-1, 2, 4, 32)
    q = (lo | (hi << 4)).reshape(-1, 16, 16).float() - 32  # (B, 16, 16)
    return ((d * sc).unsqueeze(-1) * q).reshape(-1, QK_K)


def _to_f16(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (B,) -> its fp16 bytes (B, 2) and the fp16 value as float32 (B, 1)."""
    h = v.to(torch.float16)
    return h.view(torch.uint8).reshape(-1, 2), h.float().unsqueeze(1)


def quantize_k(w: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """float (N, K), K a multiple of 256 -> raw Q4_K or Q6_K blocks, uint8 (N, K / 256 *
    block bytes)."""
    n, k = w.shape
    x = w.float().reshape(n * k // QK_K, QK_K)  # (B, 256)
    raw = _quantize_q4_k(x) if qtype == QuantType.Q4_K else _quantize_q6_k(x)
    return raw.reshape(n, k // QK_K * qtype.block_bytes)


def _quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    xs = x.reshape(-1, 8, 32)  # (B, 8, 32)
    lo = xs.amin(-1).clamp(max=0)  # (B, 8): a sub-block's min, never above 0
    scale = (xs.amax(-1) - lo) / 15  # (B, 8)
    dbytes, d = _to_f16(scale.amax(1) / 63)  # (B, 2), (B, 1)
    mbytes, dmin = _to_f16(-lo.amin(1) / 63)
    sc = torch.where(d > 0, torch.round(scale / d.clamp(min=1e-30)), 0).clamp(0, 63).long()
    mn = torch.where(dmin > 0, torch.round(-lo / dmin.clamp(min=1e-30)), 0).clamp(0, 63).long()
    ds, ms = (d * sc).unsqueeze(-1), (dmin * mn).unsqueeze(-1)  # (B, 8, 1)
    q = torch.where(ds > 0, torch.round((xs + ms) / ds.clamp(min=1e-30)), 0).clamp(0, 15)
    q = q.long().reshape(-1, 4, 2, 32)  # (B, pair, low / high, 32)
    qs = q[:, :, 0] | (q[:, :, 1] << 4)  # (B, 4, 32)
    packed = torch.zeros(x.shape[0], 12, dtype=torch.long)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return torch.cat([dbytes, mbytes, packed.to(torch.uint8),
                      qs.reshape(-1, 128).to(torch.uint8)], dim=1)


def _quantize_q6_k(x: torch.Tensor) -> torch.Tensor:
    xs = x.reshape(-1, 16, 16)  # (B, 16, 16)
    at = xs.abs().argmax(-1, keepdim=True)
    scale = xs.gather(-1, at).squeeze(-1) / -32  # (B, 16): the largest |x| maps to -32
    big = scale.gather(1, scale.abs().argmax(1, keepdim=True))  # (B, 1)
    dbytes, d = _to_f16(big.squeeze(1) / -128)
    sc = torch.where(d != 0, torch.round(scale / torch.where(d != 0, d, 1)), 0).clamp(-128, 127)
    ds = (d * sc).unsqueeze(-1)  # (B, 16, 1)
    q = torch.where(ds != 0, torch.round(xs / torch.where(ds != 0, ds, 1)), 0).clamp(-32, 31)
    q = (q.long() + 32).reshape(-1, 2, 4, 32)  # (B, half, 4 quarters, 32)
    ql = (torch.cat([q[:, :, 0] & 0x0F, q[:, :, 1] & 0x0F], dim=2)
          | (torch.cat([q[:, :, 2] & 0x0F, q[:, :, 3] & 0x0F], dim=2) << 4))  # (B, 2, 64)
    qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
          | ((q[:, :, 3] >> 4) << 6))  # (B, 2, 32)
    sc_bytes = sc.to(torch.int8).view(torch.uint8)  # (B, 16)
    return torch.cat([ql.reshape(-1, 128).to(torch.uint8), qh.reshape(-1, 64).to(torch.uint8),
                      sc_bytes, dbytes], dim=1)
