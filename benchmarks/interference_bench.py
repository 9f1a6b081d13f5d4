"""Interference: what a stream of long prompts does to the inter-token latency of running
decodes, colocated against disaggregated.

Decoders: `--decoders` closed-loop clients streaming short-prompt chats with long outputs;
their inter-token gaps (client side) are the ITL. Interferers: long prompts (`--long-tokens`
tokens of unique text, so no prefix-cache hit helps) arriving as a Poisson stream at
`--long-rate`, each asking for a few tokens. Four runs on local clusters (`baton up`):

- disaggregated without and with the long prompts: 1 prefill pod pinned to core 0, 1 decode
  pod pinned to core 1, one thread each; the router and this client stand in for other
  machines and go on `--harness-cpu` (default 1: beside the decode pod whose stream they
  relay; on core 0 they share a core with a saturated prefill pod, and its scheduling
  delays show up in the measured gaps);
- colocated without and with them: one worker with both cores.

Target (issue 4): disaggregated ITL p99 with long prompts <= 1.2x its value without them;
the colocated figure is printed beside it.

    python -m benchmarks.interference_bench [--seconds 30] [--long-rate 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

import aiohttp

from benchmarks.procs import free_port_run

MODEL = "SmolLM2-135M-Instruct"
WORDS = ("river mountain quiet engine lantern copper violet harbor meadow signal orchard "
         "thunder pencil glacier marble falcon whisper canyon ember saddle tundra velvet "
         "compass beacon ripple granite hollow jasmine kettle lumber nectar oyster pepper "
         "quartz rafter spindle timber umbra vessel willow yonder zephyr anchor bramble").split()


def pin_process(pid: int, cpus: set[int]) -> None:
    """Pin every thread of a process (torch's pool threads included) to `cpus`."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass


def long_prompt(rng: random.Random, tokens: int) -> str:
    words = [rng.choice(WORDS) for _ in range(int(tokens * 0.75))]
    return f"Document {rng.random():.12f}: " + " ".join(words) + "\nSummarise the document."


async def decoder(session, url: str, stop_at: float, gaps: list[float], ttfts: list[float],
                  max_tokens: int) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
    while time.monotonic() < stop_at:
        t0 = time.monotonic()
        last = None
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if not line.startswith(b"data: {") or b'"content":""' in line:
                    continue
                now = time.monotonic()
                if last is None:
                    ttfts.append(now - t0)
                elif now < stop_at:
                    gaps.append(now - last)
                last = now


async def interferer(session, url: str, stop_at: float, rate: float, tokens: int,
                     rng: random.Random, done: list[float]) -> None:
    tasks = []

    async def one(prompt: str) -> None:
        t0 = time.monotonic()
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 4, "ignore_eos": True, "temperature": 0}
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            await resp.read()
            if resp.status == 200:
                done.append(time.monotonic() - t0)

    while True:
        await asyncio.sleep(rng.expovariate(rate))
        if time.monotonic() >= stop_at:
            break
        tasks.append(asyncio.create_task(one(long_prompt(rng, tokens))))
    await asyncio.gather(*tasks, return_exceptions=True)


async def measure(url: str, args, with_long: bool) -> dict:
    rng = random.Random(args.seed)
    gaps: list[float] = []
    ttfts: list[float] = []
    long_done: list[float] = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        warm = time.monotonic() + 3
        await asyncio.gather(*(decoder(session, url, warm, [], [], 16)
                               for _ in range(args.decoders)))
        stop_at = time.monotonic() + args.seconds
        jobs = [decoder(session, url, stop_at, gaps, ttfts, args.output_tokens)
                for _ in range(args.decoders)]
        if with_long:
            jobs.append(interferer(session, url, stop_at, args.long_rate, args.long_tokens,
                                   rng, long_done))
        await asyncio.gather(*jobs)
    q = statistics.quantiles(gaps, n=100)
    return {"itl_p50_ms": q[49] * 1e3, "itl_p99_ms": q[98] * 1e3, "itl_n": len(gaps),
            "long_prompts_done": len(long_done),
            "long_e2e_p50_s": statistics.median(long_done) if long_done else None}


def run_variant(name: str, args, with_long: bool) -> dict:
    from baton.launch import Cluster

    port = free_port_run(4)
    disagg = name == "disaggregated"
    shape = ({"num_prefill": 1, "num_decode": 1,
              "router_args": ["--disagg-min-prefill-tokens", "256"]} if disagg
             else {"num_workers": 1})
    threads = "1" if disagg else str(len(os.sched_getaffinity(0)))
    cluster = Cluster(port=port, log_level="warning", worker_args=[
        "--dtype", args.dtype, "--num-threads", threads, "--kv-transport", "tcp"]
        if disagg else ["--dtype", args.dtype, "--num-threads", threads], **shape)
    here = os.sched_getaffinity(0)
    try:
        cluster.start()
        if disagg:  # prefill on core 0, decode on core 1, router + client on --harness-cpu
            for child in cluster.procs:
                cpu = {"prefill": 0, "decode": 1}.get(child.name.split("-")[0],
                                                      args.harness_cpu)
                pin_process(child.proc.pid, {cpu})
            os.sched_setaffinity(0, {args.harness_cpu})
        result = asyncio.run(measure(cluster.router_url, args, with_long))
    finally:
        os.sched_setaffinity(0, here)
        cluster.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--long-rate", type=float, default=0.5, help="long prompts per second")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--harness-cpu", type=int, default=1, choices=[0, 1],
                    help="disaggregated runs: the core of the router and this client (1: "
                         "beside decode, as its own relay; 0: beside the busy prefill pod)")
    ap.add_argument("--variants", default="disaggregated,colocated")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = ap.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("the interference benchmark needs at least 2 CPU cores")
    rows = {}
    for name in args.variants.split(","):
        for with_long in (False, True):
            key = f"{name}{' + long prompts' if with_long else ''}"
            print(f"== {key}", flush=True)
            rows[key] = run_variant(name, args, with_long)
            shown = {k: round(v, 2) if isinstance(v, float) else v
                     for k, v in rows[key].items()}
            print(f"   {json.dumps(shown)}", flush=True)
    print(f"\n{'':28s} {'ITL p50 ms':>11s} {'ITL p99 ms':>11s} {'long done':>10s}")
    for key, r in rows.items():
        print(f"{key:28s} {r['itl_p50_ms']:11.1f} {r['itl_p99_ms']:11.1f} "
              f"{r['long_prompts_done']:10d}")
    for name in args.variants.split(","):
        base, loaded = rows[name], rows[f"{name} + long prompts"]
        target = " (target <= 1.2x)" if name == "disaggregated" else ""
        print(f"{name:14s} ITL p99 with long prompts / without: "
              f"{loaded['itl_p99_ms'] / base['itl_p99_ms']:.2f}x{target}")
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
