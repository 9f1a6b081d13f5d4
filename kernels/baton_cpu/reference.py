"""Pure-torch references of the fused ops (`ops.py`), rounding where the model's torch code
rounds: the tests hold the C kernels to these (bit for bit where `ops.py` says so), and these
to the model's torch code. The linears' reference is a float32 matmul; the attention kernels
are held to the torch attention backend's own paths (`tests/kernels/cpu/`,
`tests/unit/engine/test_attention.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual (T, h) or None, weight (h,) -> (RMSNorm(x + residual), x + residual): the
    sum in x's dtype, the norm in float32, the weight applied in x's dtype."""
    if residual is not None:
        x = x + residual
    normed = F.rms_norm(x.float(), weight.shape, eps=eps)
    return weight * normed.to(x.dtype), x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I) gate columns first -> SiLU(gate) * up (T, I)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
           signed_sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """As `CpuOps.rotary`: rotate-half rotary of the q and k heads of qkv rows by the (P, D)
    tables' rows at `positions` -> q (T, H, D), k (T, KVH, D)."""
    H, KVH, D = num_heads, num_kv_heads, head_dim
    x = qkv[:, :(H + KVH) * D].reshape(-1, H + KVH, D)  # (T, H + KVH, D)
    c, s = cos[positions].unsqueeze(1), signed_sin[positions].unsqueeze(1)  # (T, 1, D)
    swapped = torch.cat((x[..., D // 2:], x[..., :D // 2]), dim=-1)
    q, k = torch.addcmul(x * c, swapped, s).split([H, KVH], dim=1)
    return q.contiguous(), k.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K), weight (N, K) -> (M, N) in float32 (the kernels' tests allow their rounding)."""
    y = x.float() @ weight.float().T
    return y if bias is None else y + bias.float()


def lora_add(x: torch.Tensor, y: torch.Tensor, row_slots: torch.Tensor, a: torch.Tensor,
             b: list[torch.Tensor], parts: list[tuple[int, int]]) -> torch.Tensor:
    """`lora.NativeLoRA.add`'s result: y (M, out) plus, for each row m with slot s >= 0 and
    each part p, (A_s[p R:(p + 1) R] x[m]) @ B_p[s] on columns parts[p], in float32, rounded
    to y's dtype once; a (slots, P R, in), b[p] (slots, R, cols_p)."""
    out = y.float().clone()
    rank = b[0].shape[1]
    for m, s in enumerate(row_slots.tolist()):
        if s < 0:
            continue
        t = a[s].float() @ x[m].float()  # (P R,)
        for p, (first, cols) in enumerate(parts):
            out[m, first:first + cols] += t[p * rank:(p + 1) * rank] @ b[p][s].float()
    return out.to(y.dtype)
