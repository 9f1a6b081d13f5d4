"""A worker restarted with the disk tier serves its sessions' next turns warm (issue 36).

    python -m benchmarks.kv_tier_restart [--sessions 8] [--turns 4] [--out result.json]

One `baton serve` at a time on loopback. Each run sends the first `--turns` turns of every
session of `loadtest/workloads/multi_turn.yaml` (one at a time), stops the worker
gracefully (SIGTERM: with `--kv-disk-dir`, the pool's and the host tier's blocks are written
out), starts it again on the same directory, and sends every session's next turn
(`max_tokens` 1, so the time is the turn's prefill and loads: TTFT). Two runs: the host tier
over a disk tier, and the host tier alone (a restart starts cold). Reported: the next
turns' TTFT p50, the prompt tokens the restarted worker computed, those it read back from
disk, and its greedy first tokens' text (equal in both runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks.kv_tier_bench import cpu_model
from benchmarks.kv_tier_serving import COUNTERS, MODEL, counters, workload
from benchmarks.procs import free_port, tail, wait_ready

DISK_READS = "baton:kv_offload_disk_read_blocks_total"


def serve(port: int, disk: Path | None, blocks: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "baton.cli", "serve", "--port", str(port), "--log-level",
           "warning", "--num-kv-blocks", str(blocks), "--kv-offload-gib", "0.25"]
    if disk is not None:
        cmd += ["--kv-disk-dir", str(disk), "--kv-disk-gib", "2"]
    with log.open("ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    wait_ready(f"http://127.0.0.1:{port}", proc, 600)
    return proc


def complete(url: str, prompt: str, max_tokens: int) -> tuple[float, str]:
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        answer = json.loads(resp.read())
    took = time.perf_counter() - t0
    return took, answer["choices"][0]["text"]


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()  # a graceful drain: the disk tier writes what the pools hold
    proc.wait(120)


def run(sessions: list[list], turns: int, disk: Path | None, blocks: int, log: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(port, disk, blocks, log)
    try:
        for t in range(turns):
            for turns_of in sessions:
                complete(url, turns_of[t].prompt, turns_of[t].max_tokens)
        stop(proc)
        t0 = time.perf_counter()
        proc = serve(port, disk, blocks, log)
        restart_s = time.perf_counter() - t0
        before = counters(url, (*COUNTERS, DISK_READS))
        ttft, first = [], []
        for turns_of in sessions:
            took, tokens = complete(url, turns_of[turns].prompt, 1)
            ttft.append(took)
            first.append(tokens)
        after = counters(url, (*COUNTERS, DISK_READS))
    except BaseException:
        print(tail(log), file=sys.stderr)
        raise
    finally:
        if proc.poll() is None:
            stop(proc)
    return {"ttft_p50_s": statistics.median(ttft), "ttft_s": ttft,
            "prefill_tokens": int(after["baton:prompt_tokens_total"]
                                  - before["baton:prompt_tokens_total"]),
            "disk_read_blocks": int(after[DISK_READS] - before[DISK_READS]),
            "restart_s": restart_s, "first_tokens": first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4, help="turns before the restart")
    ap.add_argument("--num-kv-blocks", type=int, default=512)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    _, reqs, _, _ = workload(args.sessions, args.turns + 1, 0.0)
    sessions = [[r for r in reqs if r.session == s] for s in range(args.sessions)]
    tmp = Path(tempfile.mkdtemp(prefix="kv-tier-restart-"))
    runs = {"host + disk tier": run(sessions, args.turns, tmp / "disk", args.num_kv_blocks,
                                    tmp / "disk.log"),
            "host tier only": run(sessions, args.turns, None, args.num_kv_blocks,
                                  tmp / "host.log")}
    warm, cold = runs["host + disk tier"], runs["host tier only"]
    result = {"cpu": cpu_model(), "sessions": args.sessions, "turns_before": args.turns,
              "runs": {k: {f: v for f, v in r.items() if f != "first_tokens"}
                       for k, r in runs.items()},
              "ttft_p50_speedup": cold["ttft_p50_s"] / warm["ttft_p50_s"],
              "greedy_first_tokens_equal": warm["first_tokens"] == cold["first_tokens"]}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
