"""Serving-path overhead: the same work offline (`LLM.generate`), through one `baton serve`
worker, and through `baton up --workers 1` (router + worker), in one run.

The workload is the offline benchmark's (seeded lognormal chat lengths, token-id prompts,
`ignore_eos`, `min_tokens = max_tokens`, greedy, prefix caching off), sent all at once as
streaming completions. Each path reports output tokens per second over the whole batch,
TTFT and inter-token latency (the gaps between content events) p50 / p99, its rate over the
offline rate, and where the CPU went: per output token, the CPU time of the engine thread,
torch's compute threads, the worker's event loop, the router process and the load generator
(read from /proc per thread before and after the timed batch, so it holds on a loaded
machine where wall-clock rates do not).

    python -m benchmarks.serving_bench [--num-requests 64] [--dtype bfloat16]
        [--paths offline,serve,up] [--rounds 3] [--json out.json]

With `--rounds N` the paths run N times in turn and each path's row is the round of median
ratio to its own round's offline rate (`make bench-serving` runs 3).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from baton_loadtest.workload import OfflineRequest, chat_workload
from benchmarks.procs import free_port, free_port_run, sse_events, wait_ready
from benchmarks.threads_cpu import cpu_by_role

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class StreamStats:
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)  # between content events
    tokens: int = 0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def run_offline(reqs: list[OfflineRequest], engine_args: dict) -> dict:
    from baton import LLM, SamplingParams

    gc.collect()
    llm = LLM(**engine_args)
    llm.generate([[1, 2, 3, 4]] * 4, SamplingParams(max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, min_tokens=r.max_tokens,
                             ignore_eos=True) for r in reqs]
    before = cpu_by_role([os.getpid()], main_role="engine thread")
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    cpu = _minus(cpu_by_role([os.getpid()], main_role="engine thread"), before)
    if [len(o.outputs[0].token_ids) for o in outs] != [r.max_tokens for r in reqs]:
        raise RuntimeError("offline: a request got a different number of tokens than asked")
    del llm
    gc.collect()
    return {"seconds": elapsed, "cpu_s": cpu}


def _minus(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


async def _stream(session: aiohttp.ClientSession, url: str, req: OfflineRequest) -> StreamStats:
    body = {"model": MODEL, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens,
            "min_tokens": req.max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    st = StreamStats()
    t0 = time.perf_counter()
    last = None
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {await resp.text()}")
        async for event in sse_events(resp):
            if event.get("usage"):
                st.tokens = event["usage"]["completion_tokens"]
            choices = event.get("choices") or ()
            if not choices or choices[0].get("text") is None:
                continue
            now = time.perf_counter()
            if last is None:
                st.ttft = now - t0
            else:
                st.gaps.append(now - last)
            last = now
    if st.tokens != req.max_tokens:
        raise RuntimeError(f"{url}: got {st.tokens} tokens, asked {req.max_tokens}")
    return st


async def _send_all(url: str, reqs: list[OfflineRequest], server_pid: int
                    ) -> tuple[float, list[StreamStats], dict[str, float]]:
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        await asyncio.gather(*(_stream(session, url, r) for r in reqs[:4]))  # warm up
        pids = [server_pid]
        before = cpu_by_role(pids) | {"load generator": time.process_time()}
        t0 = time.perf_counter()
        stats = await asyncio.gather(*(_stream(session, url, r) for r in reqs))
        elapsed = time.perf_counter() - t0
        after = cpu_by_role(pids) | {"load generator": time.process_time()}
        return elapsed, stats, _minus(after, before)


def run_server(reqs: list[OfflineRequest], path: str, worker_flags: list[str]) -> dict:
    if path == "serve":
        port = free_port()
        cmd = [sys.executable, "-m", "baton.cli", "serve", "--port", str(port),
               "--log-level", "warning", *worker_flags]
    else:
        port = free_port_run(4)
        cmd = [sys.executable, "-m", "baton.cli", "up", "--port", str(port), "--workers",
               "1", "--log-level", "warning", *worker_flags]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd)
    try:
        wait_ready(url, proc, 600)
        elapsed, stats, cpu = asyncio.run(_send_all(url + "/v1/completions", reqs, proc.pid))
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    gaps = [g for s in stats for g in s.gaps]
    ttfts = [s.ttft for s in stats]
    return {"seconds": elapsed, "cpu_s": cpu, "ttft_p50_ms": 1e3 * _pct(ttfts, 0.5),
            "ttft_p99_ms": 1e3 * _pct(ttfts, 0.99), "itl_p50_ms": 1e3 * _pct(gaps, 0.5),
            "itl_p99_ms": 1e3 * _pct(gaps, 0.99),
            "itl_mean_ms": 1e3 * statistics.fmean(gaps) if gaps else float("nan")}


def _print_cpu(rows: dict[str, dict], n_out: int) -> None:
    roles = sorted({k for r in rows.values() for k in r["cpu_s"]})
    print(f"\nCPU per output token (ms){'':<10}" + "".join(f"{p:>10}" for p in rows))
    for role in roles:
        print(f"  {role:<32}" + "".join(
            f"{1e3 * r['cpu_s'].get(role, 0.0) / n_out:>10.3f}" for r in rows.values()))
    print(f"  {'all':<32}" + "".join(
        f"{1e3 * sum(r['cpu_s'].values()) / n_out:>10.3f}" for r in rows.values()))


def _round(paths: list[str], reqs: list[OfflineRequest], engine_args: dict,
           flags: list[str], n_out: int) -> dict[str, dict]:
    """Each path once, in order: its row (rate, latencies, CPU)."""
    rows: dict[str, dict] = {}
    for path in paths:
        rows[path] = (run_offline(reqs, engine_args) if path == "offline"
                      else run_server(reqs, path, flags))
        rows[path]["output_tok_s"] = n_out / rows[path]["seconds"]
        print(f"{path}: {rows[path]['output_tok_s']:.1f} output tok/s", flush=True)
    return rows


def _median_round(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """One row per path: with several rounds, the round whose ratio to that round's own
    offline rate is the median (a shared machine's drift hits one round's paths alike),
    with every round's ratio (`round_ratios`)."""
    if len(rounds) == 1 or "offline" not in rounds[0]:
        return rounds[0]
    out: dict[str, dict] = {}
    for path in rounds[0]:
        ratios = [r[path]["output_tok_s"] / r["offline"]["output_tok_s"] for r in rounds]
        median = sorted(range(len(rounds)), key=lambda i: ratios[i])[len(rounds) // 2]
        out[path] = {**rounds[median][path], "ratio_to_offline": ratios[median],
                     "round_ratios": ratios}
        if path != "offline":
            print(f"{path}: x offline by round {' '.join(f'{x:.2f}' for x in ratios)}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--paths", default="offline,serve,up")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="the workers' --stream-interval (SSE chunks of at least N tokens)")
    ap.add_argument("--engine-process", default="auto", choices=("auto", "on", "off"),
                    help="the workers' --engine-process (auto: off on the CPU)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the paths this many times, alternating; each path's row is its "
                         "round of median ratio to that round's offline rate")
    args = ap.parse_args(argv)

    from baton.engine.models.loader import resolve_model_dir
    from baton.engine.tokenizer import load_tokenizer

    reqs = chat_workload(load_tokenizer(resolve_model_dir(None)), args.num_requests, args.seed)
    n_in = sum(len(r.prompt_token_ids) for r in reqs)
    n_out = sum(r.max_tokens for r in reqs)
    engine_args = {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   "enable_prefix_caching": False}
    flags = ["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--no-prefix-caching",
             "--stream-interval", str(args.stream_interval),
             "--engine-process", args.engine_process]
    print(f"workload: {len(reqs)} concurrent streams, {n_in} prompt + {n_out} output tokens, "
          f"{args.dtype}, prefix caching off, budget {args.max_num_batched_tokens} tokens "
          f"/ {args.max_num_seqs} seqs", flush=True)
    paths = args.paths.split(",")
    if unknown := [p for p in paths if p not in ("offline", "serve", "up")]:
        ap.error(f"unknown path {unknown[0]!r}")
    rounds = [_round(paths, reqs, engine_args, flags, n_out) for _ in range(args.rounds)]
    rows = _median_round(rounds)
    base = rows.get("offline", {}).get("output_tok_s")
    print(f"\n{'path':<10}{'out tok/s':>10}{'x offline':>10}{'TTFT p50':>10}{'p99':>8}"
          f"{'ITL p50':>9}{'p99':>7} (ms)")
    for path, r in rows.items():
        ratio = r.get("ratio_to_offline") or (r["output_tok_s"] / base if base
                                              else float("nan"))
        r["ratio_to_offline"] = ratio
        lat = "".join(f"{r[k]:>{w}.0f}" if k in r else f"{'-':>{w}}" for k, w in (
            ("ttft_p50_ms", 10), ("ttft_p99_ms", 8), ("itl_p50_ms", 9), ("itl_p99_ms", 7)))
        print(f"{path:<10}{r['output_tok_s']:>10.1f}{ratio:>9.2f}x{lat}")
    _print_cpu(rows, n_out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": {"requests": len(reqs), "prompt_tokens": n_in,
                                    "output_tokens": n_out, **engine_args}, "paths": rows},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
