"""KV transfer bandwidth per transport against an in-process copy of the same blocks.

The holder runs in its own process (as a prefill pod would) with the bundled model's cache
layout (30 layers, 3 KV heads, head dim 64, blocks of 16 tokens, bf16: 360 KiB a block); the
puller pulls shuffled, non-contiguous blocks into shuffled destinations. The reference is
the same gather + scatter done in one process (what any transport must at least do).

    python -m benchmarks.kv_bench [--blocks 256] [--repeats 5] [--transports tcp]

`tcp-staged` is tcp forced through its host staging buffers on both sides: the path a GPU
cache takes (here over host memory, so it measures the extra copies and the chunking).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

import torch
from pydantic import TypeAdapter

from baton.common.internal import KVEndpointInfo
from baton.kv_transfer import installed_transports, make_transport
from baton.kv_transfer.base import TransferState, gather_blocks, scatter_blocks

SHAPE = dict(layers=30, kv_heads=3, head_dim=64, block_size=16)

HOLDER = """
import json, sys, time, torch
from pydantic_core import to_jsonable_python
from benchmarks.kv_bench import make
n_blocks, repeats, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
kv = torch.randn(30, 2, n_blocks, 16, 3, 64).to(torch.bfloat16)
t = make(kind)
ep = t.start(kv, "holder")
leases = [t.hold(f"r{r}", list(range(n_blocks)), 600) for r in range(repeats + 1)]
print(json.dumps({"endpoint": to_jsonable_python(ep), "leases": leases}), flush=True)
time.sleep(3600)
"""


def make(kind: str):
    """A transport by name; `tcp-staged`: tcp through its host staging buffers."""
    if kind == "tcp-staged":
        return make_transport("tcp", stage_via_host=True)
    return make_transport(kind)


def _cache(n_blocks: int) -> torch.Tensor:
    return torch.zeros(SHAPE["layers"], 2, n_blocks, SHAPE["block_size"], SHAPE["kv_heads"],
                       SHAPE["head_dim"], dtype=torch.bfloat16)


def in_process_copy(n: int, repeats: int) -> list[float]:
    src_kv = torch.randn(SHAPE["layers"], 2, 2 * n, SHAPE["block_size"], SHAPE["kv_heads"],
                         SHAPE["head_dim"]).to(torch.bfloat16)
    dst_kv = _cache(2 * n)
    times = []
    for _ in range(repeats + 1):
        src, dst = random.sample(range(2 * n), n), random.sample(range(2 * n), n)
        t0 = time.perf_counter()
        scatter_blocks(dst_kv, dst, gather_blocks(src_kv, src))
        times.append(time.perf_counter() - t0)
    return times[1:]


def transport_pulls(kind: str, n: int, repeats: int) -> list[float]:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(2 * n), str(repeats), kind],
                              stdout=subprocess.PIPE)
    try:
        hello = json.loads(holder.stdout.readline())
        ep = TypeAdapter(KVEndpointInfo).validate_python(hello["endpoint"])
        leases = hello["leases"]
        puller = make(kind)
        puller.start(_cache(2 * n), "puller")
        puller.connect(ep)
        times = []
        for r in range(repeats + 1):
            src, dst = random.sample(range(2 * n), n), random.sample(range(2 * n), n)
            t0 = time.perf_counter()
            t = puller.pull(ep, leases[r], src, dst, timeout_s=120)
            if t.wait(120) != TransferState.DONE:
                raise RuntimeError(f"{kind} pull failed: {t.error!r}")
            times.append(time.perf_counter() - t0)
        puller.close()
        return times[1:]
    finally:
        holder.kill()
        holder.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--transports",
                    default=",".join(t for t in installed_transports() if t != "local"))
    args = ap.parse_args(argv)
    nbytes = args.blocks * 2 * SHAPE["layers"] * SHAPE["block_size"] * SHAPE["kv_heads"] \
        * SHAPE["head_dim"] * 2
    ref = statistics.median(in_process_copy(args.blocks, args.repeats))
    print(f"{args.blocks} blocks, {nbytes / 2**20:.1f} MiB per pull")
    print(f"in-process copy : {ref * 1e3:8.2f} ms  {nbytes / ref / 1e9:6.2f} GB/s  1.00x")
    for kind in args.transports.split(","):
        t = statistics.median(transport_pulls(kind, args.blocks, args.repeats))
        print(f"{kind:16s}: {t * 1e3:8.2f} ms  {nbytes / t / 1e9:6.2f} GB/s  {ref / t:.2f}x "
              "of the copy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
