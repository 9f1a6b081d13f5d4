"""The host path at GPU speed: how busy Baton keeps a simulated H100 (`--device sim`,
`engine/sim/`) and what the host costs per step, offline and through `baton serve`.

- offline, steady decode: B requests of 512 prompt tokens are prefilled (untimed), then 64
  decode steps of all B are timed through the engine loop `LLM.generate` runs; batch 1, 8,
  64, 256, 512.
- offline, mixed: 256 chat-workload requests (lognormal prompt and output lengths) at once,
  prefills and decodes sharing steps as requests finish and others start.
- `baton serve`, steady decode: B streaming clients (the load generator in this process)
  against one worker on the simulated device; the worker's own timing from `/metrics`, over
  the window in which all B decode (from the last stream's first token to the first
  stream's end: the prefills left out, as offline).
- `baton up --prefill 1 --decode 1`, mixed: the chat workload's lengths through the router,
  `--pd-concurrency` streams at a time, KV pulled over tcp (the sim's stand-in cache: real
  pulls of 16 bytes a token, so their time is not an H100's); the decode worker's busy
  fraction over the run and while it stepped.

Each reports the device-busy fraction (modelled device seconds over wall seconds) and the
milliseconds per step the device sat idle (wall less device: the host's time per step that
did not overlap a step); steady decode also the host's CPU milliseconds per step (the
engine thread's, overlapped or not: with async scheduling, the default on the simulated
device, the two differ), and serve the CPU microseconds per output token of the worker
process and of the client. Tokens are nonsense (the sim's), lengths
exact (`ignore_eos`).

    python -m benchmarks.host_bench [--profile h100-llama3-8b] [--batches 1,8,64,256,512]
        [--paths offline,mixed,serve,pd] [--pd-concurrency 64] [--async-scheduling auto|on|off]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import subprocess
import sys
import time

import aiohttp

from benchmarks.gpu_pieces import children_of
from benchmarks.procs import free_port, wait_ready

PROMPT = 512
DECODE_STEPS = 64


def _prompts(n: int, length: int = PROMPT) -> list[list[int]]:
    return [[100 + (i * 131 + j * 7) % 40000 for j in range(length)] for i in range(n)]


def offline_steady(llm, batch: int) -> dict:
    """Prefill `batch` requests, then time DECODE_STEPS steps of all of them."""
    from baton import SamplingParams

    engine = llm.engine
    # long enough that the first requests, decoding while the last ones prefill, still run
    # through the timed steps (prefill takes at most batch / 4 steps of 2,048 tokens)
    params = SamplingParams(max_tokens=DECODE_STEPS + 8 + batch, ignore_eos=True)
    reqs = [engine.make_request(f"steady-{batch}-{i}-{time.monotonic_ns()}", p, params)
            for i, p in enumerate(_prompts(batch))]
    for req in reqs:
        engine.add(req)
    while any(r.num_output_tokens == r.num_pending for r in reqs):  # a token read, each
        engine.step()
    device = engine.runner.device  # its own count of the work done, queued steps as they run
    before, busy0, t0 = engine.timing.snapshot(), device.busy_s, time.perf_counter()
    outputs = []
    cpu0 = time.thread_time()
    for _ in range(DECODE_STEPS):
        outputs += engine.step()  # what LLM.generate does with them is a dict lookup
    host_cpu = time.thread_time() - cpu0
    # with async scheduling the last step launched is still running: the window takes its
    # end too
    device.drain()
    wall = time.perf_counter() - t0
    after, busy = engine.timing.snapshot(), device.busy_s - busy0
    if len(outputs) != batch * DECODE_STEPS:
        raise RuntimeError(f"batch {batch}: {len(outputs)} outputs in {DECODE_STEPS} steps, "
                           "not a steady batch")
    engine.abort_requests([r.request_id for r in reqs])  # the rest is not measured
    steps = after.steps - before.steps
    return {"batch": batch, "busy": busy / wall, "host_ms_per_step": 1000 * (wall - busy) / steps,
            "host_cpu_ms_per_step": 1000 * host_cpu / steps,
            "step_ms": 1000 * wall / steps, "tokens_per_s": len(outputs) / wall}


def offline_mixed(llm) -> dict:
    from baton import SamplingParams
    from baton_loadtest.workload import chat_workload

    reqs = chat_workload(llm.get_tokenizer(), 256, seed=3)
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    engine = llm.engine
    before, t0 = engine.timing.snapshot(), time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params,
                        use_tqdm=False)
    wall = time.perf_counter() - t0
    after = engine.timing.snapshot()
    device = after.device_s - before.device_s
    return {"requests": len(reqs), "busy": device / wall,
            "host_ms_per_step": 1000 * (wall - device) / (after.steps - before.steps),
            "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall}


async def _client(session, url: str, prompt: list[int], max_tokens: int,
                  on_first=None) -> int:
    """One stream to its end: its completion tokens (the usage chunk's). `on_first()` when
    its first token arrives."""
    body = {"model": "sim", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if on_first is not None and line.startswith(b"data:"):
                on_first()
                on_first = None
            if line.startswith(b"data:") and b'"usage"' in line:
                usage = json.loads(line[5:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens


def _scrape(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("baton:engine_device_busy_seconds_total",
                          "baton:engine_step_seconds_total", "baton:generation_tokens_total",
                          "baton:engine_step_host_seconds_count",
                          "baton:engine_step_host_seconds_sum"):
                out[s.name] = s.value
    return out


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _worker_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds of the worker's front process and of its engine core's (its child, when
    the core runs apart; 0 otherwise)."""
    return _cpu_s(pid), sum(_cpu_s(c) for c in children_of(pid))


async def _serve_point(url: str, pid: int, batch: int) -> dict:
    """`batch` streams, measured over the window in which every one of them decodes: from
    the moment the last has its first token to the moment the first ends (prefill, and the
    streams' start and end, left out, as offline; each runs long enough to decode
    DECODE_STEPS after the others' prefills)."""
    started, all_started, one_done = [0], asyncio.Event(), asyncio.Event()

    def first() -> None:
        started[0] += 1
        if started[0] == batch:
            all_started.set()

    async def one(session, prompt) -> int:
        try:
            return await _client(session, url, prompt, DECODE_STEPS + 8 + batch, first)
        finally:
            one_done.set()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=900)) as session:
        await asyncio.gather(*(_client(session, url, p, 4) for p in _prompts(2, 16)))
        streams = asyncio.ensure_future(
            asyncio.gather(*(one(session, p) for p in _prompts(batch))))
        await asyncio.wait([streams, asyncio.ensure_future(all_started.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        if streams.done():  # ended (or failed) before every stream had started
            streams.result()
            raise RuntimeError(f"batch {batch}: a stream ended before all had started")
        m0, cpu0, me0, t0 = await _metrics(session, url), _worker_cpu_s(pid), \
            time.process_time(), time.perf_counter()
        await one_done.wait()
        m1, cpu1, me = await _metrics(session, url), _worker_cpu_s(pid), \
            time.process_time() - me0
        wall = time.perf_counter() - t0
        front, core = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
        await streams
    d = {k: m1[k] - m0.get(k, 0.0) for k in m1}
    device = d["baton:engine_device_busy_seconds_total"]
    n, steps = d["baton:generation_tokens_total"], d["baton:engine_step_host_seconds_count"]
    return {"batch": batch, "busy": device / wall, "tokens_per_s": n / wall,
            "tokens": int(n), "steps": int(steps),
            "engine_busy_while_stepping": device / d["baton:engine_step_seconds_total"],
            "host_ms_per_step": 1000 * d["baton:engine_step_host_seconds_sum"] / steps,
            "worker_cpu_us_per_token": 1e6 * (front + core) / n,
            "front_cpu_us_per_token": 1e6 * front / n, "core_cpu_us_per_token": 1e6 * core / n,
            "client_cpu_us_per_token": 1e6 * me / n}


async def _metrics(session, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        return _scrape(await r.text())


def serve(profile: str, batches: list[int], async_scheduling: str = "auto",
          engine_process: str = "auto") -> list[dict]:
    """`baton serve` on the simulated device, `batch` streaming clients a point; its engine
    core in its own process or not (`--engine-process`)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "baton.cli", "serve", "--port", str(port),
                             "--device", "sim", "--sim-profile", profile,
                             "--served-model-name", "sim", "--async-scheduling",
                             async_scheduling, "--engine-process", engine_process,
                             "--max-num-seqs",
                             str(max(batches)), "--max-waiting", str(4 * max(batches)),
                             "--log-level", "warning"])
    try:
        wait_ready(url, proc, 300)
        return [asyncio.run(_serve_point(url, proc.pid, b)) for b in batches]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


async def _pd_point(url: str, decode: str, requests, concurrency: int) -> dict:
    """The mixed (chat) workload through the router, `concurrency` streams at a time; the
    decode worker's device-busy fraction over the run and while it stepped."""
    gate = asyncio.Semaphore(concurrency)

    async def one(session, req) -> int:
        async with gate:
            return await _client(session, url, req.prompt_token_ids, req.max_tokens)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=900)) as session:
        async with session.get(decode + "/metrics") as r:
            m0 = _scrape(await r.text())
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(session, req) for req in requests))
        wall = time.perf_counter() - t0
        async with session.get(decode + "/metrics") as r:
            m1 = _scrape(await r.text())
    d = {k: m1[k] - m0.get(k, 0.0) for k in m1}
    device = d["baton:engine_device_busy_seconds_total"]
    return {"requests": len(requests), "concurrency": concurrency, "busy": device / wall,
            "busy_while_stepping": device / d["baton:engine_step_seconds_total"],
            "tokens_per_s": sum(tokens) / wall}


def pd(profile: str, concurrency: int, async_scheduling: str = "auto",
       engine_process: str = "auto") -> dict:
    """`baton up --prefill 1 --decode 1` on the simulated device (KV over tcp, the sim's
    stand-in cache), the chat workload's lengths (`ignore_eos`)."""
    import tempfile
    from pathlib import Path

    from baton.engine.models.loader import resolve_model_dir
    from baton.engine.tokenizer import load_tokenizer
    from baton_loadtest.workload import chat_workload
    from benchmarks.gpu_scenarios import baton_up

    requests = chat_workload(load_tokenizer(resolve_model_dir(None)), 4 * concurrency, seed=5)
    flags = ["--prefill", "1", "--decode", "1", "--kv-transport", "tcp", "--device", "sim",
             "--sim-profile", profile, "--served-model-name", "sim", "--async-scheduling",
             async_scheduling, "--engine-process", engine_process,
             "--max-num-seqs", str(max(concurrency, 8)),
             "--max-waiting", str(8 * concurrency)]
    with tempfile.TemporaryDirectory() as tmp, \
            baton_up(flags, 2, 300, Path(tmp) / "up.log") as (url, workers):
        return asyncio.run(_pd_point(url, workers[1], requests, concurrency))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="h100-llama3-8b")
    parser.add_argument("--batches", default="1,8,64,256,512")
    parser.add_argument("--paths", default="offline,mixed,serve,pd")
    parser.add_argument("--pd-concurrency", type=int, default=64,
                        help="streams at once through `baton up --prefill 1 --decode 1`")
    parser.add_argument("--json", default=None)
    parser.add_argument("--async-scheduling", default="auto", choices=("auto", "on", "off"),
                        help="the engine's (auto: on, the simulated device runs asynchronously)")
    parser.add_argument("--engine-process", default="auto", choices=("auto", "on", "off"),
                        help="baton serve's and the decode pod's engine core in its own "
                             "process (auto: on for the simulated device)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    paths = args.paths.split(",")
    result: dict = {"profile": args.profile}
    print(f"--device sim --sim-profile {args.profile}; host: {os.cpu_count()} cores")
    if "offline" in paths or "mixed" in paths:
        from baton import LLM

        llm = LLM(device="sim", sim_profile=args.profile, max_num_seqs=max(batches + [256]),
                  async_scheduling={"auto": None, "on": True, "off": False}[
                      args.async_scheduling])
        llm.generate([[1, 2, 3]], use_tqdm=False)
        gc.collect()  # a long-lived engine's heap, as `baton serve` freezes it once loaded
        gc.freeze()
        if "offline" in paths:
            result["offline"] = [offline_steady(llm, b) for b in batches]
            for r in result["offline"]:
                print(f"offline b{r['batch']:<4} busy {r['busy']:.3f}  device idle "
                      f"{r['host_ms_per_step']:.3f} ms/step  host CPU "
                      f"{r['host_cpu_ms_per_step']:.3f} ms/step  step {r['step_ms']:.2f} ms",
                      flush=True)
        if "mixed" in paths:
            r = result["mixed"] = offline_mixed(llm)
            print(f"offline mixed busy {r['busy']:.3f}  host {r['host_ms_per_step']:.3f} "
                  f"ms/step", flush=True)
        del llm
    if "serve" in paths:
        result["serve"] = serve(args.profile, batches, args.async_scheduling,
                                args.engine_process)
        for r in result["serve"]:
            print(f"serve   b{r['batch']:<4} busy {r['busy']:.3f}  host "
                  f"{r['host_ms_per_step']:.3f} ms/step  worker "
                  f"{r['worker_cpu_us_per_token']:.0f} us/token (front "
                  f"{r['front_cpu_us_per_token']:.0f}, core {r['core_cpu_us_per_token']:.0f})"
                  f"  client "
                  f"{r['client_cpu_us_per_token']:.0f} us/token", flush=True)
    if "pd" in paths:
        r = result["pd"] = pd(args.profile, args.pd_concurrency, args.async_scheduling,
                                  args.engine_process)
        print(f"up P/D  c{r['concurrency']:<4} decode busy {r['busy']:.3f}  while stepping "
              f"{r['busy_while_stepping']:.3f}  {r['tokens_per_s']:.0f} tokens/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
