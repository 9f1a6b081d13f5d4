"""The tensor-parallel group a model is built in and runs with.

A model's parallel layers (`models/layers.py`) read `tp_group()` when they are built: which
slice of each weight this rank holds and which collectives its forward needs. With one rank
(the default) every collective is the identity and nothing imports torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks (in place where it can be)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `x` concatenated along `dim`, rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """`x` as rank 0 holds it, on every rank (in place). Through the group's own
        backend, not `dist.broadcast` (whose source is a rank of the default group this
        one is not registered in). On NCCL the wait only orders the current stream."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.group.broadcast([x], opts).wait()
        return x

    def split(self, total: int, what: str) -> tuple[int, int]:
        """(offset, size) of this rank's equal share of `total` rows of `what`."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) does not divide by the tensor-parallel size "
                             f"{self.size}")
        n = total // self.size
        return self.rank * n, n


_SINGLE = TPGroup()
_current = _SINGLE


def tp_group() -> TPGroup:
    return _current


def set_tp_group(group: TPGroup | None) -> None:
    """Make `group` the one models are built in (None: a single rank)."""
    global _current
    _current = group or _SINGLE
