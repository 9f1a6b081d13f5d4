"""Run-time adapter loads against running streams, through one `baton serve` worker (issue 40:
"loading an adapter at run time does not stall running streams", ITL p99 while adapters load
within 20% of before). `python -m benchmarks.lora_bench --serve` runs it:

A worker on loopback serves the bundled model with LoRA (`--max-loras 2`, adapter `a0`
loaded at start); `--streams` closed-loop clients stream greedy chat completions of
`--tokens` tokens (`ignore_eos`), half of them with the base model and half with `a0`. Time
is cut into windows of `--phase-seconds`, alternating quiet (no loads) and loading (a client
POSTs /v1/load_lora_adapter of a fresh name, then /v1/unload_lora_adapter, back to back),
`--rounds` of each, with a second between windows left out (a load still running as its
window ends finishes there). ITL: the gaps between consecutive content events of one
response (a token each, but a token the detokenizer holds back merges into the next event),
each counted in the window its later event arrived in.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from benchmarks.procs import free_port, sse_events, tail, wait_ready

GUARD_S = 1.0  # left out between windows
Window = tuple[float, float, str]  # start, end (perf_counter), phase


def windows(start: float, phase_s: float, rounds: int, guard: float = GUARD_S) -> list[Window]:
    """quiet, loading, quiet, loading, ... from `start`: `rounds` windows of each phase."""
    out, t = [], start
    for _ in range(rounds):
        for phase in ("quiet", "loading"):
            out.append((t, t + phase_s, phase))
            t += phase_s + guard
    return out


def window_of(t: float, wins: list[Window]) -> int | None:
    return next((i for i, (t0, t1, _) in enumerate(wins) if t0 <= t < t1), None)


def by_window(responses: list[list[float]], wins: list[Window]) -> list[dict]:
    """Per window: the inter-event gaps (s) of each response's event arrival times, counted
    in the window of the later event, and the events that arrived in it."""
    out: list[dict] = [{"gaps": [], "events": 0} for _ in wins]
    for times in responses:
        for i, t in enumerate(times):
            w = window_of(t, wins)
            if w is None:
                continue
            out[w]["events"] += 1
            if i:
                out[w]["gaps"].append(t - times[i - 1])
    return out


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); nan for none."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def start_server(adapter: Path, streams: int, threads: int | None, log: Path
                 ) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "baton.cli", "serve", "--port", str(port),
           "--host", "127.0.0.1", "--served-model-name", "base", "--log-level", "warning",
           "--max-num-seqs", str(streams), "--kv-cache-gib", "0.5", "--max-loras", "2",
           "--max-lora-rank", "16", "--max-cpu-loras", "4", "--lora-modules", f"a0={adapter}"]
    if threads:
        cmd += ["--num-threads", str(threads)]
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


async def stream(client: aiohttp.ClientSession, url: str, model: str, tokens: int, until: float,
                 out: list[list[float]]) -> None:
    """Responses one after the other until `until`: each one's content event times in `out`."""
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    while time.perf_counter() < until:
        times: list[float] = []
        out.append(times)
        async with client.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
            async for event in sse_events(resp):
                now = time.perf_counter()
                if "error" in event:
                    raise RuntimeError(f"{model}: error mid-stream: {event['error']}")
                if any(c.get("delta", {}).get("content") for c in event.get("choices", ())):
                    times.append(now)
                    if now >= until:
                        break


async def load_unload(client: aiohttp.ClientSession, url: str, name: str, path: Path) -> float:
    """One run-time load and unload of `name`: the load call's seconds."""
    t0 = time.perf_counter()
    async with client.post(url + "/v1/load_lora_adapter",
                           json={"lora_name": name, "lora_path": str(path)}) as resp:
        answer = await resp.text()
    seconds = time.perf_counter() - t0
    if resp.status != 200:
        raise RuntimeError(f"load {name}: HTTP {resp.status}: {answer}")
    async with client.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"unload {name}: HTTP {resp.status}: {await resp.text()}")
    return seconds


async def loader(client: aiohttp.ClientSession, url: str, path: Path, wins: list[Window],
                 loads: list[tuple[float, float]]) -> None:
    """Back-to-back loads and unloads of fresh names through each loading window:
    (start time, load seconds) of each in `loads`."""
    for t0, t1, phase in wins:
        if phase != "loading":
            continue
        await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
        while (start := time.perf_counter()) < t1:
            loads.append((start, await load_unload(client, url, f"busy{len(loads)}", path)))


async def measure(url: str, path: Path, args) -> tuple[list[Window], list[list[float]],
                                                       list[tuple[float, float]]]:
    """Warm up (streams and two loads), then the windows: (windows, responses, loads)."""
    models = ["base", "a0"] * args.streams
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=0)) as client:
        for i in range(2):
            await load_unload(client, url, f"warm{i}", path)
        warm_until = time.perf_counter() + 3.0
        await asyncio.gather(*(stream(client, url, models[i], 16, warm_until, [])
                               for i in range(args.streams)))
        wins = windows(time.perf_counter() + GUARD_S, args.phase_seconds, args.rounds)
        responses: list[list[float]] = []
        loads: list[tuple[float, float]] = []
        await asyncio.gather(loader(client, url, path, wins, loads),
                             *(stream(client, url, models[i], args.tokens, wins[-1][1],
                                      responses) for i in range(args.streams)))
    return wins, responses, loads


def report(wins: list[Window], responses: list[list[float]], loads: list[tuple[float, float]],
           phase_s: float, rounds: int) -> None:
    per_window = by_window(responses, wins)
    print(f"phases alternate quiet / loading, {rounds} x {phase_s:.0f} s each, "
          f"{GUARD_S:.0f} s left out between windows; ITL p99 by window: " + ", ".join(
              f"{phase} {1e3 * percentile(w['gaps'], 0.99):.1f}"
              for (_, _, phase), w in zip(wins, per_window)) + " ms")
    p99 = {}
    for phase in ("quiet", "loading"):
        mine = [i for i, (_, _, p) in enumerate(wins) if p == phase]
        gaps = [g for i in mine for g in per_window[i]["gaps"]]
        events = sum(per_window[i]["events"] for i in mine)
        secs = [s for t, s in loads if window_of(t, wins) in mine]
        p99[phase] = 1e3 * percentile(gaps, 0.99)
        med = f"{statistics.median(secs):.3f} s" if secs else "-"
        print(f"{phase:<8} ITL p50 {1e3 * percentile(gaps, 0.5):6.1f} ms  p99 {p99[phase]:6.1f}"
              f" ms  max {1e3 * max(gaps, default=float('nan')):6.1f} ms  "
              f"{events / (phase_s * rounds):6.1f} tok/s ({len(gaps)} gaps)  "
              f"loads {len(secs)} (median load call {med})", flush=True)
    print(f"ITL p99 loading / quiet: {p99['loading'] / p99['quiet']:.2f}x "
          f"(target <= 1.20x)", flush=True)


def run(args, adapters: list[Path], tmp: Path) -> None:
    """The measurement: `adapters[0]` served as a0, `adapters[1]` loaded in the loop."""
    log = tmp / "serve.log"
    proc, url = start_server(adapters[0], args.streams, args.threads, log)
    try:
        wait_ready(url, proc, 300, probe="/v1/models")  # /ready can lead the pipeline
        wins, responses, loads = asyncio.run(measure(url, adapters[1], args))
    except Exception:
        print(f"worker log tail:\n{tail(log)}", file=sys.stderr)
        raise
    finally:
        stop_server(proc)
    print(f"{args.streams} streams (half base, half adapter a0), {args.tokens} tokens each, "
          f"greedy, ignore_eos", flush=True)
    report(wins, responses, loads, args.phase_seconds, args.rounds)
