"""The pieces every architecture builds from: RMSNorm, tensor-parallel linears and
embeddings, each parameter with the `weight_loader` that copies a checkpoint tensor's slice
into it.

Tensor parallelism follows Megatron: a column-parallel linear holds this rank's rows of the
output (q/k/v heads, gate/up features), a row-parallel one this rank's columns of the input,
and its caller all-reduces the partial sums (`TPGroup.all_reduce`) — outside the linear, so
the CPU platform may swap the `nn.Linear` itself. KV heads are replicated when there are fewer of
them than ranks. The embedding and the LM head are split by vocabulary rows.

Loading: a checkpoint tensor reaches a parameter through `param.weight_loader(param,
tensor, shard)`, where `shard` names the part of a fused parameter it fills ("q", "k", "v";
0 / 1 for gate / up; or anything the builder defined). Each parameter lists the shards it
needs in `param.shards`; the loader checks that every one arrived.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.distributed import TPGroup, tp_group

Loader = Callable[[nn.Parameter, torch.Tensor, object], None]


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as Hugging Face does), with the residual add fused in:
    returns (norm(x + residual), x + residual). `offset` 1.0 is Gemma's `(1 + w)` form."""

    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
        return self.norm(x), x

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """Just the norm of x (any leading shape), no residual."""
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        if self.offset:
            return (normed * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)


_Param = TypeVar("_Param", bound=torch.Tensor)  # a Parameter (nn.Linear's are typed Tensor)


def set_loader(param: _Param, loader: Loader, shards: Iterable[object] = (None,)) -> _Param:
    # attributes torch lets a tensor carry, read back by name when a checkpoint loads
    param.weight_loader = loader  # type: ignore[attr-defined]  # a dynamic attribute
    param.shards = frozenset(shards)  # type: ignore[attr-defined]  # a dynamic attribute
    return param


def copy_loader(param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
    """The whole tensor, same shape (norms, replicated weights)."""
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a "
                         f"parameter of shape {tuple(param.shape)}")
    param.data.copy_(loaded)


def column_linear(in_features: int, parts: Sequence[tuple[object, int, int]], bias: bool,
                  tp: TPGroup | None = None) -> nn.Linear:
    """A column-parallel linear fused from `parts`: (shard name, rows in the checkpoint
    tensor, rows of each of its `size`-row units this rank takes) — given as (shard, total
    rows, unit rows). A unit is a head (head_dim rows) or one feature (1 row); this rank
    takes units [rank * n / size, (rank + 1) * n / size), or, when there are fewer units
    than ranks, the one unit `rank * n // size` (replicated KV heads)."""
    tp = tp or tp_group()
    layout: dict[object, tuple[int, int, int]] = {}  # shard -> (dst offset, src offset, rows)
    offset = 0
    for shard, total, unit in parts:
        units = total // unit
        if units >= tp.size:
            first, count = tp.split(units, f"{shard!r} of a fused linear")
        else:
            if tp.size % units:
                raise ValueError(f"{units} heads cannot be replicated over {tp.size} ranks")
            first, count = tp.rank * units // tp.size, 1
        layout[shard] = (offset, first * unit, count * unit)
        offset += count * unit
    linear = nn.Linear(in_features, offset, bias=bias)
    # each shard's (first row, rows) of the output, read by engine.lora
    shard_rows = {s: (dst, rows) for s, (dst, _, rows) in layout.items()}
    linear.shard_rows = shard_rows  # type: ignore[assignment]  # a dynamic attribute

    def loader(param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
        dst, src, rows = layout[shard]
        param.data.narrow(0, dst, rows).copy_(loaded.narrow(0, src, rows))

    set_loader(linear.weight, loader, layout)
    if bias:
        set_loader(linear.bias, loader, layout)
    return linear


def qkv_linear(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
               tp: TPGroup | None = None) -> nn.Linear:
    """q, k, v projections fused (shards "q", "k", "v"), this rank's heads."""
    return column_linear(hidden, [("q", num_heads * head_dim, head_dim),
                                  ("k", num_kv_heads * head_dim, head_dim),
                                  ("v", num_kv_heads * head_dim, head_dim)], bias, tp)


def local_heads(num_heads: int, tp: TPGroup | None = None) -> int:
    """How many of `num_heads` heads this rank holds (1 when replicated)."""
    tp = tp or tp_group()
    return num_heads // tp.size if num_heads >= tp.size else 1


def merged_linear(in_features: int, sizes: Sequence[int], bias: bool = False,
                  tp: TPGroup | None = None) -> nn.Linear:
    """Column-parallel linears fused along the output (gate and up: shards 0, 1, ...)."""
    return column_linear(in_features, [(i, n, 1) for i, n in enumerate(sizes)], bias, tp)


def row_linear(in_features: int, out_features: int, bias: bool = False,
               tp: TPGroup | None = None) -> nn.Linear:
    """A row-parallel linear: this rank's columns of the input; the caller all-reduces.
    Its bias (if any) is held by rank 0 only, so the sum adds it once."""
    tp = tp or tp_group()
    first, n = tp.split(in_features, "a row-parallel linear's input")
    linear = nn.Linear(n, out_features, bias=bias)

    def weight(param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
        param.data.copy_(loaded.narrow(1, first, n))

    def bias_(param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
        param.data.copy_(loaded if tp.rank == 0 else torch.zeros_like(loaded))

    set_loader(linear.weight, weight)
    if bias:
        set_loader(linear.bias, bias_)
    return linear


class VocabEmbedding(nn.Module):
    """The token embedding split by vocabulary rows over the ranks (padded to divide);
    `weight` is this rank's rows. `scale` multiplies the output (Gemma's sqrt(hidden))."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup | None = None,
                 scale: float | None = None) -> None:
        super().__init__()
        self.tp = tp or tp_group()
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // self.tp.size)
        self.first = self.tp.rank * self.rows
        self.weight = set_loader(nn.Parameter(torch.empty(self.rows, hidden)),
                                 self._load)
        self.scale = scale

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
        n = max(0, min(self.rows, self.vocab_size - self.first))
        param.data.zero_()
        param.data.narrow(0, 0, n).copy_(loaded.narrow(0, self.first, n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            x = F.embedding(ids, self.weight)
        else:
            local = ids - self.first
            outside = (local < 0) | (local >= self.rows)
            x = F.embedding(local.masked_fill(outside, 0), self.weight)
            x = self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))
        if self.scale is not None:
            x = x * torch.tensor(self.scale, dtype=x.dtype)  # rounded as HF rounds it
        return x


def lm_head(vocab_size: int, hidden: int, tp: TPGroup | None = None) -> nn.Linear:
    """This rank's vocabulary rows of the LM head (gathered in `gather_logits`)."""
    tp = tp or tp_group()
    rows = -(-vocab_size // tp.size)
    first = tp.rank * rows
    linear = nn.Linear(hidden, rows, bias=False)

    def loader(param: nn.Parameter, loaded: torch.Tensor, shard: object = None) -> None:
        n = max(0, min(rows, vocab_size - first))
        param.data.zero_()
        param.data.narrow(0, 0, n).copy_(loaded.narrow(0, first, n))

    set_loader(linear.weight, loader)
    return linear


def gather_logits(local: torch.Tensor, vocab_size: int, tp: TPGroup) -> torch.Tensor:
    """(N, rows) logits of this rank's vocabulary rows -> (N, V) float32 on every rank."""
    return tp.all_gather(local.float(), dim=-1)[:, :vocab_size]
