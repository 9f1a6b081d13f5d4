"""The expert computation of a sparse mixture-of-experts layer: routing and a grouped matmul.

Routing: softmax over the router's logits (float32), the top-k experts of each token, their
probabilities renormalised to sum to 1 where the architecture does (Mixtral always,
Qwen3-MoE when `norm_topk_prob`).

Experts: the E experts' weights are stacked, gate_up (E, 2I, h) with the gate rows first and
down (E, h, I) — I is this rank's slice of each expert's intermediate size under tensor
parallelism. The T * k (token, expert) pairs are sorted by expert, so each expert's rows are
contiguous, and every expert multiplies its rows at once: one `torch._grouped_mm` over all
experts where this torch has one that runs for the dtype and device, else one matmul per
expert that received tokens. Each pair's output is weighted by its routing probability and
the k outputs of a token summed (float32) in place of scattering with atomics.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

SiluMul = Callable[[torch.Tensor], torch.Tensor]  # (N, 2I) gate first -> (N, I)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) router logits -> (T, k) float32 weights and (T, k) int64 expert ids, in
    decreasing probability."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # (T, E)
    weights, ids = torch.topk(probs, top_k, dim=-1)  # (T, k), (T, k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor,
                  silu_mul: SiluMul | None = None) -> torch.Tensor:
    """x (T, h), stacked gate_up (E, 2I, h) and down (E, h, I), routing (T, k) weights and
    ids -> (T, h): sum over each token's k experts of weight * down(SiLU(gate) * up).
    Under tensor parallelism a partial sum over this rank's I; the caller all-reduces.
    `silu_mul` is a fused kernel where the platform has one (`platforms/cpu_layers.py`)."""
    T, k = ids.shape
    if T == 0:
        return torch.zeros_like(x)
    flat = ids.reshape(-1)  # (T k,) expert of each (token, slot) pair
    order = torch.argsort(flat, stable=True)  # (T k,) pairs sorted by expert
    counts = torch.bincount(flat, minlength=gate_up.shape[0])  # (E,) pairs per expert
    rows = x[order // k]  # (T k, h) each pair's token, expert-contiguous
    h1 = grouped_matmul(rows, gate_up, counts)  # (T k, 2I)
    if silu_mul is not None:
        act = silu_mul(h1)  # (T k, I)
    else:
        gate, up = h1.chunk(2, dim=-1)
        act = F.silu(gate) * up  # (T k, I)
    out = grouped_matmul(act, down, counts)  # (T k, h), sorted order
    pairs = torch.empty_like(out)
    pairs[order] = out  # (T k, h) back in (token, slot) order
    summed = (pairs.view(T, k, -1).float() * weights.unsqueeze(-1)).sum(dim=1)  # (T, h)
    return summed.to(x.dtype)


def grouped_matmul(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor
                   ) -> torch.Tensor:
    """rows (N, K) sorted by expert with counts (E,) rows each, weight (E, M, K) -> (N, M):
    expert e's rows times weight[e]^T."""
    E, M, K = weight.shape
    if grouped_mm_works(rows.dtype, rows.device.type, K, M):
        offsets = counts.cumsum(0).to(torch.int32)  # (E,) end of each expert's rows
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=offsets)
    return looped_matmul(rows, weight, counts)


def looped_matmul(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor
                  ) -> torch.Tensor:
    """`grouped_matmul` as one matmul per expert with rows (the fallback)."""
    out = rows.new_empty(rows.shape[0], weight.shape[1])  # (N, M)
    start = 0
    for expert, n in enumerate(counts.tolist()):
        if n:
            torch.mm(rows[start:start + n], weight[expert].t(), out=out[start:start + n])
            start += n
    return out


@functools.cache
def grouped_mm_works(dtype: torch.dtype, device: str, K: int, M: int) -> bool:
    """Whether `torch._grouped_mm` exists here and computes an (_, K) x (E, K, M) product
    with empty groups right for this dtype, device and shape (CUDA wants bf16 on recent
    GPUs and aligned strides; older torches lack it). Probed once per key."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(6, K, generator=gen).to(device=device, dtype=dtype)
    weight = torch.randn(3, M, K, generator=gen).to(device=device, dtype=dtype)
    counts = torch.tensor([2, 0, 4], device=device)
    try:
        got = torch._grouped_mm(rows, weight.transpose(1, 2),
                                offs=counts.cumsum(0).to(torch.int32))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    want = looped_matmul(rows, weight, counts)
    return bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2 * K ** 0.5))
