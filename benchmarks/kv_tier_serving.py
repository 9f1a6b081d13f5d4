"""The host offload tier through `baton serve` (issue 36): the `multi_turn` workload's
sessions, concurrent, each turn sent a think time after the previous one ended, against one
worker with and without `--kv-offload-gib`, at the same device pool (a quarter of the
sessions' working set).

    python -m benchmarks.kv_tier_serving [--sessions 16] [--turns 8] [--think 2.0]
        [--offload-gib 2] [--pool-fraction 0.25] [--out result.json]

`--sessions 64 --turns 8 --think 5` is the workload as written (`loadtest/workloads/
multi_turn.yaml`; ~45 minutes of our 2-core machine without the tier). The load generator
is the project's own (`baton_loadtest`, streaming completions, recorded answers, so every
turn's prompt extends the last one's). Reported per run: TTFT p50 / p90 of turns >= 2 (at
the client), prompt tokens the engine computed against those served from its prefix cache
or the tier (the worker's `/metrics`), and the wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.kv_tier_bench import BLOCK, WORKLOAD, cpu_model
from benchmarks.lora_serving import percentile, stop_server
from benchmarks.procs import free_port, tail, wait_ready

MODEL = "SmolLM2-135M-Instruct"  # the bundled model's served name
COUNTERS = ("baton:prompt_tokens_total", "baton:prefix_cache_hit_tokens_total",
            "baton:kv_offload_hit_tokens_total")


def workload(sessions: int, turns: int, think_s: float):
    from baton.engine.models.loader import resolve_model_dir
    from baton.engine.tokenizer import load_tokenizer
    from baton_loadtest.generator import plan
    from baton_loadtest.spec import WorkloadSpec

    spec = WorkloadSpec.load(WORKLOAD)
    spec = replace(spec, num_requests=sessions * turns, sessions=replace(
        spec.sessions, count=sessions, turns=turns, think_time_s=think_s))
    tokenizer = load_tokenizer(resolve_model_dir(None))
    reqs, factory = plan(spec, tokenizer)
    last = {r.session: r for r in reqs}  # each session's last turn: its longest prompt
    lengths = [len(tokenizer.encode(r.prompt)) + r.max_tokens for r in last.values()]
    return spec, reqs, factory, lengths


def counters(url: str, names: tuple[str, ...] = COUNTERS) -> dict[str, float]:
    """Each metric of `names` on the worker's `/metrics`, summed over its labels."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        page = resp.read().decode()
    out = dict.fromkeys(names, 0.0)
    for line in page.splitlines():
        name = line.partition(" ")[0].partition("{")[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def run_one(spec, reqs, factory, blocks: int, offload_gib: float, threads: int | None,
            log: Path) -> dict:
    from baton_loadtest.client import ClientSettings
    from baton_loadtest.runner import run_plan

    port = free_port()
    cmd = [sys.executable, "-m", "baton.cli", "serve", "--port", str(port), "--log-level",
           "warning", "--num-kv-blocks", str(blocks), "--max-num-seqs", "64"]
    if offload_gib:
        cmd += ["--kv-offload-gib", str(offload_gib)]
    if threads:
        cmd += ["--num-threads", str(threads)]
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc, 600)
        before = counters(url)
        settings = ClientSettings(url, MODEL, api="completions")
        records, wall = asyncio.run(run_plan(spec, reqs, factory, settings, progress=False))
        after = counters(url)
    except BaseException:
        print(tail(log), file=sys.stderr)
        raise
    finally:
        stop_server(proc)
    failed = [r for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0].error}")
    first = {}
    for r in sorted(records, key=lambda r: r.sent_s):
        first.setdefault(r.session, r.index)
    later = [r.ttft_s for r in records if r.index != first[r.session]]
    delta = {k: after[k] - before[k] for k in COUNTERS}
    return {"ttft_p50_s": statistics.median(later), "ttft_p90_s": percentile(later, 0.9),
            "prefill_tokens": int(delta["baton:prompt_tokens_total"]),
            "cached_tokens": int(delta["baton:prefix_cache_hit_tokens_total"]
                                 + delta["baton:kv_offload_hit_tokens_total"]),
            "tier_hit_tokens": int(delta["baton:kv_offload_hit_tokens_total"]),
            "requests": len(records), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--think", type=float, default=2.0, help="seconds between turns")
    ap.add_argument("--offload-gib", type=float, default=2.0)
    ap.add_argument("--pool-fraction", type=float, default=0.25)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    spec, reqs, factory, lengths = workload(args.sessions, args.turns, args.think)
    working_set = sum(-(-n // BLOCK) for n in lengths)
    # a quarter of the working set, but room for the longest conversation twice over
    blocks = max(int(args.pool_fraction * working_set), 2 * -(-max(lengths) // BLOCK))
    logs = Path(tempfile.mkdtemp(prefix="kv-tier-serving-"))
    runs = {}
    for name, gib in (("no tier", 0.0), (f"--kv-offload-gib {args.offload_gib:g}",
                                          args.offload_gib)):
        t0 = time.perf_counter()
        runs[name] = run_one(spec, reqs, factory, blocks, gib, args.num_threads,
                             logs / f"{'tier' if gib else 'none'}.log")
        print(f"{name}: {json.dumps(runs[name])} ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr)
    base, tier = runs["no tier"], runs[f"--kv-offload-gib {args.offload_gib:g}"]
    result = {"cpu": cpu_model(), "sessions": args.sessions, "turns": args.turns,
              "think_s": args.think, "working_set_blocks": working_set,
              "pool_blocks": blocks, "runs": runs,
              "ttft_p50_speedup": base["ttft_p50_s"] / tier["ttft_p50_s"],
              "prefill_tokens_saved": 1 - tier["prefill_tokens"] / base["prefill_tokens"]}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
