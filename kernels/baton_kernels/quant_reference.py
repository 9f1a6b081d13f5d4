"""Pure-torch references for the quantized-weight GEMMs (`quant_gemm`, `fp8_gemm`): the
weights de-quantized to float32 and one matmul, written for clarity, not speed (any device;
the CPU path can serve with them).

Integer weights: ``w[n, k] = scales[n, g(k)] * (codes[n, k] - zeros[n, g(k)])``, ``g(k) =
g_idx[k]`` when given (GPTQ act-order), else ``k // group_size``; zeros None means the
symmetric zero ``2^(bits - 1)``.

FP8 weights (float8_e4m3fn ``[N, K]``): ``w[n, k] = fp8[n, k] * s``, ``s`` one of ``w_scale``
``[1]`` (per tensor), ``[N]`` (per channel) or ``[ceil(N / bn), ceil(K / bk)]`` at
``[n // bn, k // bk]`` with ``block = (bn, bk)``. Activations quantized for an FP8 GEMM: with
a static ``input_scale`` [1], ``x / input_scale``; dynamic, one scale per token (or per
token and group of ``bk`` columns for block-wise weights) = ``max(amax, 1e-10) / 448``; each
saturated to +-448 and rounded to e4m3 (nearest, ties to even).
"""

from __future__ import annotations

import torch

from baton_kernels.reference import to_cache

FP8_MAX = 448.0  # float8_e4m3fn's largest value
AMAX_FLOOR = 1e-10  # a row of zeros still gets a finite scale


def group_of_each_column(k: int, group_size: int, g_idx: torch.Tensor | None,
                         device: torch.device) -> torch.Tensor:
    """``g(k)`` for every column: int64 ``[K]``."""
    if g_idx is not None:
        return g_idx.to(device=device, dtype=torch.int64)
    return torch.arange(k, device=device) // group_size


def dequantize_int_weight(codes: torch.Tensor, scales: torch.Tensor,
                          zeros: torch.Tensor | None, g_idx: torch.Tensor | None,
                          group_size: int, bits: int) -> torch.Tensor:
    """uint8 codes ``[N, K]`` -> float32 ``[N, K]`` by the formula above."""
    groups = group_of_each_column(codes.shape[1], group_size, g_idx, codes.device)
    s = scales.float()[:, groups]                                       # (N, K)
    z = (zeros.float()[:, groups] if zeros is not None
         else torch.full_like(s, float(1 << (bits - 1))))               # (N, K)
    return s * (codes.float() - z)


def int_weight_gemm_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                        zeros: torch.Tensor | None, g_idx: torch.Tensor | None,
                        group_size: int, bits: int) -> torch.Tensor:
    """``x [M, K] @ w.T`` in float32, returned in x's dtype ``[M, N]``."""
    w = dequantize_int_weight(codes, scales, zeros, g_idx, group_size, bits)
    return (x.float() @ w.t()).to(x.dtype)


def dequantize_fp8_weight(w: torch.Tensor, w_scale: torch.Tensor,
                          block: tuple[int, int] | None = None) -> torch.Tensor:
    """float8_e4m3fn ``[N, K]`` -> float32 ``[N, K]`` times its scales (module docstring)."""
    n, k = w.shape
    scale = w_scale.float()
    if block is not None:
        bn, bk = block
        scale = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]  # (N, K)
    elif scale.numel() == n and n > 1:
        scale = scale.reshape(n, 1)                                      # per channel
    else:
        scale = scale.reshape(1, 1)                                      # per tensor
    return w.float() * scale


def quantize_fp8_activations_ref(x: torch.Tensor, input_scale: torch.Tensor | None,
                                 group: int | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` -> (float8_e4m3fn ``[M, K]``, float32 scales ``[M, G]``): G = 1 per token
    (group None) or static, else ``ceil(K / group)``; a static scale is repeated there."""
    m, k = x.shape
    width = group or k
    count = -(-k // width)
    if input_scale is not None:
        scales = input_scale.float().reshape(1, 1).expand(m, count)
    else:
        padded = torch.zeros(m, count * width, dtype=torch.float32, device=x.device)
        padded[:, :k] = x.float().abs()
        amax = padded.reshape(m, count, width).amax(dim=2)                 # (M, G)
        scales = amax.clamp_min(AMAX_FLOOR) / FP8_MAX
    per_column = scales.repeat_interleave(width, dim=1)[:, :k]           # (M, K)
    return to_cache(x.float() / per_column, torch.float8_e4m3fn), scales.contiguous()


def fp8_weight_gemm_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                        block: tuple[int, int] | None, input_scale: torch.Tensor | None,
                        quantize_activations: bool) -> torch.Tensor:
    """``x @ w.T`` in float32 with the weight de-quantized, returned in x's dtype. With
    `quantize_activations`, x first goes through FP8 as the W8A8 paths quantize it (per
    token, per token-group of bk for block-wise weights, or the static scale)."""
    weight = dequantize_fp8_weight(w, w_scale, block)
    acts = x.float()
    if quantize_activations:
        group = block[1] if block is not None else None
        q, scales = quantize_fp8_activations_ref(x, input_scale, group)
        width = group or x.shape[1]
        acts = q.float() * scales.repeat_interleave(width, dim=1)[:, :x.shape[1]]
    return (acts @ weight.t()).to(x.dtype)
