"""Router overhead: latency the router adds per streaming request, at several concurrencies.

Clients stream completions either straight to an upstream or through `baton router` in
front of the same upstream, in alternating rounds (so drift on a noisy machine hits both
paths alike); for each path it records time to first byte (TTFB) and end-to-end latency,
and reports p50/p99 per path and router minus direct.

Upstreams: `sim` (default) is `benchmarks.sim_worker`, a simulated worker with fixed
token timing, which isolates the router's cost; `real` is a `baton serve` worker on the
bundled model (noisier: its latency depends on how requests batch).

`--pin` puts the router on the last CPU and the clients and upstream on the others, as in a
deployment where the router has a core of its own; without it all three compete for the
same cores and the router's CPU time shows up as extra latency of the clients and upstream.

    python -m benchmarks.router_bench [--upstream sim|real] [--concurrency 1,16,64] [--pin]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import aiohttp

from benchmarks.procs import free_port, wait_ready


@dataclass
class Sample:
    ttfb: float
    e2e: float


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def _one(session: aiohttp.ClientSession, url: str, body: bytes) -> Sample:
    t0 = time.perf_counter()
    async with session.post(url, data=body,
                            headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {await resp.text()}")
        first = None
        tail = b""
        async for chunk in resp.content.iter_any():
            if first is None:
                first = time.perf_counter()
            tail = (tail + chunk)[-32:]
        if not tail.endswith(b"data: [DONE]\n\n"):
            raise RuntimeError(f"{url}: stream ended without [DONE]")
    return Sample(first - t0, time.perf_counter() - t0)


async def _round(url: str, body: bytes, concurrency: int, n: int) -> list[Sample]:
    connector = aiohttp.TCPConnector(limit=0)
    out: list[Sample] = []
    async with aiohttp.ClientSession(connector=connector) as session:
        todo = iter(range(n))

        async def client() -> None:
            for _ in todo:
                out.append(await _one(session, url, body))

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return out


def measure(direct: str, routed: str, model: str, concurrency: int, n: int, rounds: int,
            max_tokens: int) -> dict:
    body = json.dumps({"model": model, "prompt": "Tell me about the sea.",
                       "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                       "stream": True}).encode()
    # Warm-up: connections, caches, JITs on both paths.
    asyncio.run(_round(direct, body, concurrency, concurrency))
    asyncio.run(_round(routed, body, concurrency, concurrency))
    samples: dict[str, list[Sample]] = {"direct": [], "router": []}
    for r in range(rounds):
        order = [("direct", direct), ("router", routed)]
        for name, url in (order if r % 2 == 0 else order[::-1]):
            samples[name] += asyncio.run(_round(url, body, concurrency, n // rounds))
    row = {"concurrency": concurrency, "requests_per_path": len(samples["direct"])}
    for metric in ("ttfb", "e2e"):
        for q, qn in ((0.5, "p50"), (0.99, "p99")):
            d = _pct([getattr(s, metric) for s in samples["direct"]], q)
            rt = _pct([getattr(s, metric) for s in samples["router"]], q)
            row[f"{metric}_{qn}_direct_ms"] = d * 1e3
            row[f"{metric}_{qn}_router_ms"] = rt * 1e3
            row[f"{metric}_{qn}_added_ms"] = (rt - d) * 1e3
    row["e2e_mean_added_ms"] = 1e3 * (statistics.fmean(s.e2e for s in samples["router"])
                                      - statistics.fmean(s.e2e for s in samples["direct"]))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", choices=["sim", "real"], default="sim")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--requests", type=int, default=None,
                    help="per path and concurrency (default: 40 x concurrency, >= 400)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--itl", type=float, default=0.005, help="sim upstream's token gap")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--pin", action="store_true",
                    help="router on the last CPU, clients and upstream on the others")
    args = ap.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    router_cpus = harness_cpus = None
    if args.pin:
        if len(cpus) < 2:
            ap.error("--pin needs at least two CPUs")
        router_cpus, harness_cpus = {cpus[-1]}, set(cpus[:-1])
        os.sched_setaffinity(0, harness_cpus)  # this process and the upstream it spawns
    up_port, router_port = free_port(), free_port()
    up_url, router_url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{router_port}"
    if args.upstream == "sim":
        model = "sim"
        up_cmd = [sys.executable, "-m", "benchmarks.sim_worker", "--port", str(up_port),
                  "--tokens", str(args.max_tokens), "--itl", str(args.itl)]
    else:
        model = "SmolLM2-135M-Instruct"
        up_cmd = [sys.executable, "-m", "baton.cli", "serve", "--port", str(up_port),
                  "--num-threads", "1", "--log-level", "warning"]
    procs = [subprocess.Popen(up_cmd)]
    try:
        wait_ready(up_url, procs[0], 300)
        procs.append(subprocess.Popen([
            sys.executable, "-m", "baton.cli", "router", "--port", str(router_port),
            "--workers", up_url, "--log-level", "warning"],
            preexec_fn=(lambda: os.sched_setaffinity(0, router_cpus)) if router_cpus else None))
        wait_ready(router_url, procs[1], 60)
        rows = []
        for c in (int(x) for x in args.concurrency.split(",")):
            n = args.requests or max(400, 40 * c)
            row = measure(up_url + "/v1/completions", router_url + "/v1/completions", model,
                          c, n, args.rounds, args.max_tokens)
            rows.append(row)
            print(f"c={c:3d} n={row['requests_per_path']:5d} | TTFB p50 "
                  f"{row['ttfb_p50_direct_ms']:7.2f} -> {row['ttfb_p50_router_ms']:7.2f} ms "
                  f"(+{row['ttfb_p50_added_ms']:.2f}), p99 +{row['ttfb_p99_added_ms']:.2f} | "
                  f"E2E p50 {row['e2e_p50_direct_ms']:7.2f} -> "
                  f"{row['e2e_p50_router_ms']:7.2f} ms (+{row['e2e_p50_added_ms']:.2f}), "
                  f"p99 +{row['e2e_p99_added_ms']:.2f}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"upstream": args.upstream, "rows": rows}, f, indent=2)
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
