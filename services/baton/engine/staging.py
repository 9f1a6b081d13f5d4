"""Host → device staging: a step's small integer and float arrays reach the device in one
copy.

On CUDA the arrays are packed into a persistent pinned buffer and copied with one
non-blocking copy: from pageable memory a copy waits for the stream (the forward pass in
flight) and runs synchronously, from pinned memory it is queued like a kernel. The buffer
grows when a step needs more and is reused across steps; an event recorded after each copy
is waited on before the buffer is written again, so a copy still in flight never reads the
next step's values (in practice it has long finished: every step reads its sampled tokens
back). On any other device there is no pinned memory (a CPU-only torch refuses it): the
arrays are packed into a fresh buffer and moved with one `.to(device)` — on CPU that is no
copy at all, the returned tensors are views of the packed buffer.

Used from the engine loop thread only (the batch builder and the sampler, each with its own
`HostStaging`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class HostStaging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned: torch.Tensor | None = None  # (capacity,) int64, CUDA only
        self._copied: torch.cuda.Event | None = None  # after the last copy out of it

    def pack(self, ints: Sequence[Sequence[int] | np.ndarray],
             floats: Sequence[Sequence[float] | np.ndarray] = (),
             float_dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
        """The 1-D parts as tensors on the device, in order: `ints` int64, then `floats` as
        `float_dtype` (exact float64 on the way), moved there with one copy. The caller
        owns the result; the host side is reused by the next `pack`."""
        sizes = [len(p) for p in ints] + [len(p) for p in floats]
        total = sum(sizes)
        host_t = self._host(total)
        host = host_t.numpy()
        at = 0
        for part in ints:
            host[at:at + len(part)] = part
            at += len(part)
        num_ints = at
        as_float = host[num_ints:total].view(np.float64)
        for fpart in floats:
            as_float[at - num_ints:at - num_ints + len(fpart)] = fpart
            at += len(fpart)
        dev = self._to_device(host_t if host_t.numel() == total else host_t[:total])
        if not floats:
            return list(dev.split(sizes))
        floats_out = dev[num_ints:].view(torch.float64).to(float_dtype)
        return [*dev[:num_ints].split(sizes[:len(ints)]), *floats_out.split(sizes[len(ints):])]

    def _host(self, n: int) -> torch.Tensor:
        """A host int64 buffer of at least n values, free to write."""
        if self.device.type != "cuda":
            return torch.empty(n, dtype=torch.int64)  # a fresh one: the views outlive the step
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy out of it has finished
        if self._pinned is None or self._pinned.numel() < n:
            cap = max(n, 2 * (0 if self._pinned is None else self._pinned.numel()), 4096)
            self._pinned = torch.empty(cap, dtype=torch.int64, pin_memory=True)
        return self._pinned

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return host.to(self.device)
        dev = host.to(self.device, non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()
        return dev

