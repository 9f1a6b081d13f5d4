"""GGUF's block formats in plain torch, the reference `csrc/linear_q.c` is tested against.

A tensor of N rows of K elements is stored as N x K / 32 blocks, row-major (as in the file
and `gguf.GGUFReader`'s `data`, uint8 (N, K / 32 * block bytes)):

- Q8_0 (34 bytes): fp16 d, 32 x int8 q; w = d * q.
- Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles; w = d * (q - 8).
- Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m.

Nibble byte i holds element i in its low half and element i + 16 in its high half.
"""

from __future__ import annotations

from enum import IntEnum

import torch

QK = 32  # elements per block


class QuantType(IntEnum):
    """The GGML type ids (`gguf.GGMLQuantizationType`) of the formats served natively."""

    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8

    @property
    def block_bytes(self) -> int:
        return {QuantType.Q4_0: 18, QuantType.Q4_1: 20, QuantType.Q8_0: 34}[self]


def dequantize(raw: torch.Tensor, qtype: QuantType, k: int) -> torch.Tensor:
    """raw uint8 (N, k / 32 * block bytes) -> float32 (N, k)."""
    n = raw.shape[0]
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
