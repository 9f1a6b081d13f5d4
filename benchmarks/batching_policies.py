"""The three batching policies of the textbook side by side: `static` (fixed groups run to
completion, padded), `dynamic` (the same groups, each collected within a window) and
continuous `fcfs` (Orca: requests join and leave every step), on the chat workload
(lognormal prompt and output lengths, `baton_loadtest.workload.chat_workload`) arriving as
a Poisson process, through the engine's asynchronous front (`AsyncEngine`, the one
`baton serve` streams from), on the simulated GPU (`--device sim`) or the real model on CPU.

Reported per policy: output tokens/s over the run, TTFT and inter-token latency p50 / p99
(as clients see them: arrival to first token, gaps between tokens), and the share of the
tokens the steps computed that were padding (`EngineCore.stats.padded_tokens_total`).

    python -m benchmarks.batching_policies --device sim [--profile h100-llama3-8b]
        [--requests 512] [--rate 40] [--max-num-seqs 64] [--window-ms 50] [--json out.json]
    python -m benchmarks.batching_policies --device cpu --requests 48 --rate 2 \
        --max-num-seqs 8 --max-output 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import replace

import numpy as np

POLICIES = ("static", "dynamic", "fcfs")


def engine_for(policy: str, args: argparse.Namespace):
    from baton.engine.async_engine import AsyncEngine
    from baton.engine.config import EngineConfig

    extra = (dict(device="sim", sim_profile=args.profile) if args.device == "sim"
             else dict(device="cpu", num_threads=args.threads))
    config = EngineConfig.from_args(scheduling_policy=policy, max_num_seqs=args.max_num_seqs,
                                    batch_window_ms=args.window_ms, **extra)
    engine = AsyncEngine(config)
    engine.start()
    return engine


async def _client(engine, i: int, delay: float, prompt: list[int], max_tokens: int) -> dict:
    from baton import SamplingParams

    await asyncio.sleep(delay)
    t0 = time.perf_counter()
    stamps: list[float] = []
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    seen = 0
    async for out in engine.generate(prompt, params, request_id=f"p{i}"):
        now = time.perf_counter()
        n = len(out.outputs[0].token_ids)
        stamps += [now] * (n - seen)  # tokens that arrived together share their time
        seen = n
    return {"ttft": stamps[0] - t0, "gaps": np.diff(stamps).tolist(), "tokens": seen,
            "end": stamps[-1]}


async def run_policy(policy: str, args: argparse.Namespace, workload) -> dict:
    engine = engine_for(policy, args)
    try:
        arrivals = np.cumsum(np.random.default_rng(args.seed).exponential(1 / args.rate,
                                                                           len(workload)))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(
            _client(engine, i, float(at), r.prompt_token_ids, r.max_tokens)
            for i, (at, r) in enumerate(zip(arrivals, workload, strict=True))))
        wall = max(r["end"] for r in results) - t0
        stats = engine.core.stats
    finally:
        engine.shutdown()
    ttft = np.array([r["ttft"] for r in results])
    gaps = np.array([g for r in results for g in r["gaps"]] or [0.0])
    return {"policy": policy, "tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50_ms": 1000 * float(np.percentile(ttft, 50)),
            "ttft_p99_ms": 1000 * float(np.percentile(ttft, 99)),
            "itl_p50_ms": 1000 * float(np.percentile(gaps, 50)),
            "itl_p99_ms": 1000 * float(np.percentile(gaps, 99)),
            "padded_share": stats.padded_tokens_total / max(1, stats.step_tokens_total),
            "wall_s": wall}


def make_workload(args: argparse.Namespace):
    from baton.engine.models.loader import resolve_model_dir
    from baton.engine.tokenizer import load_tokenizer
    from baton_loadtest.workload import chat_workload

    tokenizer = load_tokenizer(resolve_model_dir(None))
    return [replace(r, max_tokens=min(r.max_tokens, args.max_output))
            for r in chat_workload(tokenizer, args.requests, seed=args.seed)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("sim", "cpu"), default="sim")
    ap.add_argument("--profile", default="h100-llama3-8b")
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--rate", type=float, default=40.0, help="arrivals per second (Poisson)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--window-ms", type=float, default=50.0, help="dynamic's window")
    ap.add_argument("--max-output", type=int, default=512, help="cap on output lengths")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    workload = make_workload(args)
    rows = [asyncio.run(run_policy(p, args, workload)) for p in args.policies.split(",")]
    print(f"{args.device} ({args.profile if args.device == 'sim' else 'bundled model'}), "
          f"{args.requests} chat requests at {args.rate}/s, max_num_seqs {args.max_num_seqs}, "
          f"dynamic window {args.window_ms} ms")
    print(f"{'policy':8} {'tok/s':>9} {'TTFT p50':>9} {'p99':>9} {'ITL p50':>8} {'p99':>8} "
          f"{'padded':>7}")
    for r in rows:
        print(f"{r['policy']:8} {r['tokens_per_s']:9.1f} {r['ttft_p50_ms']:9.1f} "
              f"{r['ttft_p99_ms']:9.1f} {r['itl_p50_ms']:8.2f} {r['itl_p99_ms']:8.2f} "
              f"{r['padded_share']:7.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
