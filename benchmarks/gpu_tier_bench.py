"""The host KV offload tier's copies on the device (issue 36): bandwidth each way between the
device KV cache and the tier's pinned host blocks, and what those copies cost a step.

    python -m benchmarks.gpu_tier_bench [--shape bundled|llama3-8b] [--blocks 256]
        [--json result.json]

The copies are the tier's own (`HostKVPool.store` / `load`: one `copy_` per block, issued
without waiting, on the current stream), timed with CUDA events around `--blocks` of them:
GB/s = blocks x block bytes / time. Each loaded block is checked against the one offloaded.

The step: a stand-in for a decode step of similar length (a chain of bf16 matmuls, ~5 ms on
an H100), timed alone, then with one step's worth of offloads (`MAX_OFFLOADS_PER_STEP`, or
`--blocks` if fewer) issued right before it, as the engine issues them (evictions during
`schedule()`, then the forward). `overlap` = 1 - (step with copies - step alone) / (copies
alone): 0 when they serialize on the stream, 1 when the copies are free.

On a machine without CUDA it runs the same on CPU at the given sizes (a smoke test of the
code path; the numbers are memcpy's). The last line printed is the JSON of every number
(also written to `--json PATH`, rewritten as each part ends).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch

from benchmarks.timing import sync, time_calls

SHAPES = {  # (layers, KV heads, head dim): per 16-token bf16 block 368 KiB / 2 MiB
    "bundled": (30, 3, 64),
    "llama3-8b": (32, 8, 128),
}


def tier(shape: str, blocks: int, device: torch.device):
    from baton.engine.kv_tier.host_pool import HostKVPool

    layers, heads, dim = SHAPES[shape]
    cache = torch.randn(layers, 2, 2 * blocks, 16, heads, dim, dtype=torch.bfloat16,
                        device=device)
    return cache, HostKVPool(cache, blocks)


def copy_bandwidth(cache: torch.Tensor, pool, blocks: int, device: torch.device) -> dict:
    """Offload device blocks [0, n) (fresh hashes each time, so every store copies), load the
    last ones offloaded into [n, 2n), check them, and time each direction."""
    fresh = itertools.count(1)
    held: list[int] = []

    def offload() -> None:
        held.clear()
        for i in range(blocks):
            held.append(next(fresh))
            pool.store(held[-1], i)

    def load() -> None:
        for i, block_hash in enumerate(held):
            pool.load(block_hash, blocks + i)

    out_s = min(time_calls(offload, device, 3, warmup=1))
    in_s = min(time_calls(load, device, 3, warmup=1))
    sync(device)
    same = bool(torch.equal(cache[:, :, blocks:2 * blocks], cache[:, :, :blocks]))
    nbytes = blocks * pool.block_bytes
    return {"blocks": blocks, "block_bytes": pool.block_bytes,
            "offload_gbps": nbytes / out_s / 1e9, "load_gbps": nbytes / in_s / 1e9,
            "offload_s": out_s, "load_s": in_s, "loaded_equal_offloaded": same}


def step_overlap(cache: torch.Tensor, blocks: int, device: torch.device) -> dict:
    """A decode-step stand-in alone, one step's offload copies alone, and both back to
    back as the engine runs them."""
    from baton.engine.kv_tier.connector import MAX_OFFLOADS_PER_STEP
    from baton.engine.kv_tier.host_pool import HostKVPool

    n = min(blocks, MAX_OFFLOADS_PER_STEP)
    size, chain = (4096, 48) if device.type == "cuda" else (256, 4)
    x = torch.randn(256, size, dtype=torch.bfloat16, device=device)
    w = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    pool, fresh = HostKVPool(cache, n), itertools.count(1)

    def step() -> None:
        y = x
        for _ in range(chain):
            y = y @ w

    def copies() -> None:
        for i in range(n):
            pool.store(next(fresh), i)

    def both() -> None:
        copies()
        step()

    alone = statistics.median(time_calls(step, device, 10))
    copy = statistics.median(time_calls(copies, device, 10))
    together = statistics.median(time_calls(both, device, 10))
    return {"step_ms": alone * 1e3, "offloads": n, "offloads_ms": copy * 1e3,
            "step_with_offloads_ms": together * 1e3,
            "overlap": 1 - (together - alone) / copy if copy > 0 else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=tuple(SHAPES), default="bundled")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                    else "cpu", "shape": args.shape}

    def write() -> None:
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
    cache, pool = tier(args.shape, args.blocks, device)
    result["copies"] = copy_bandwidth(cache, pool, args.blocks, device)
    write()
    result["step"] = step_overlap(cache, args.blocks, device)
    write()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
