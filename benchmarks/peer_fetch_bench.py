"""Peer fetch (issue 36): the TTFT of a conversation's next turn after it moved to another
decode pod, its prefix pulled from the pod it left versus prefilled again.

    python -m benchmarks.peer_fetch_bench [--sessions 4] [--min-context 2000] [--out r.json]

Real processes on loopback: a Redis registry, two decode pods (`baton serve --role decode`,
one thread each, tcp KV transport) and two routers on the same registry, one with peer fetch
(`--peer-fetch`) and one without (`--no-peer-fetch`), both weighing session affinity above
the rest (`--weights session=3,...`) so a session goes where its key sends it: the router
moved it. The conversations are `loadtest/workloads/multi_turn.yaml`'s, as token ids
(`kv_tier_bench.conversations`): each session's turn is the first whose context reaches
`--min-context` tokens, and the turn before it ran on pod A. Then, one request at a time:

- `stayed`: the turn on pod A again (its prefix a device hit there),
- `moved, peer fetch`: the turn on pod B through the peer-fetch router (B pulls the prefix
  from A over tcp and prefills the rest),
- `moved, recompute`: the turn on pod B through the other router (B prefills it all).

Each group has its own sessions (a pod that pulled or computed a prefix holds it after).
TTFT is the time to the first streamed token, at the client. (That a pulled prefix gives
the same greedy tokens as computing it is the tests' to prove: tests/unit/engine/
test_disagg.py, tests/integration/test_registry_routing.py.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.kv_tier_bench import conversations, cpu_model
from benchmarks.lora_serving import stop_server
from benchmarks.procs import free_port, sse_events, tail, wait_ready

MODEL = "SmolLM2-135M-Instruct"  # the bundled model's served name
WEIGHTS = "session=3,prefix=1,queue=1,kv_usage=1,lora=0.75"
GROUPS = ("stayed", "moved, peer fetch", "moved, recompute")


def start(args: list[str], log: Path) -> subprocess.Popen:
    with log.open("wb") as f:
        return subprocess.Popen([sys.executable, "-m", "baton.cli", *args,
                                 "--log-level", "warning"], stdout=f, stderr=subprocess.STDOUT)


def session_on(pod: str, pods: list[str], taken: set[str]) -> str:
    """A new session key the routers' rendezvous hashing gives `pod` of `pods`."""
    from baton.router.scheduling.context import RoutingContext
    from baton.router.scheduling.scorers import session

    ups = [SimpleNamespace(url=u) for u in pods]
    for i in range(10_000):
        key = f"user-{i}"
        if key not in taken and session(ups, RoutingContext(session=key))[pods.index(pod)]:
            taken.add(key)
            return key
    raise RuntimeError("no session key for " + pod)


async def turn(http, router: str, ids: list[int], user: str, max_tokens: int
               ) -> tuple[float, list[str], dict]:
    """One streamed completion of `ids`: its TTFT, its text pieces and its usage."""
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "user": user}
    t0 = time.perf_counter()
    ttft, text, usage = None, [], {}
    async with http.post(router + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for event in sse_events(resp):
            if "error" in event:
                raise RuntimeError(f"error mid-stream: {event['error']}")
            for c in event.get("choices", ()):
                if c.get("text"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(c["text"])
            usage = event.get("usage") or usage
    assert ttft is not None, "no token came"
    return ttft, text, usage


async def measure(routers: dict[str, str], pods: list[str], convs: list[list[list[int]]],
                  min_context: int, max_tokens: int) -> dict:
    import aiohttp

    a, b = pods
    taken: set[str] = set()
    out: dict = {g: {"ttft_s": [], "cached_tokens": [], "context": [], "text": []}
                 for g in GROUPS}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await turn(http, routers["peer"], convs[0][0][:64], "warm-up", 2)  # tokenizer fetch
        await asyncio.sleep(1.0)
        for i, conv in enumerate(convs):
            group = GROUPS[i % len(GROUPS)]
            t = next((k for k, ids in enumerate(conv) if len(ids) >= min_context and k > 0),
                     len(conv) - 1)
            await turn(http, routers["peer"], conv[t - 1], session_on(a, pods, taken),
                       max_tokens)
            await asyncio.sleep(0.5)  # A's block events reach the routers
            router = routers["recompute" if group.endswith("recompute") else "peer"]
            pod = a if group == "stayed" else b
            ttft, text, usage = await turn(http, router, conv[t], session_on(pod, pods, taken),
                                           max_tokens)
            out[group]["ttft_s"].append(ttft)
            out[group]["context"].append(len(conv[t]))
            out[group]["cached_tokens"].append(
                (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
            out[group]["text"].append("".join(text))
    return out


def report(out: dict, cpu: str, args) -> dict:
    p50 = {g: statistics.median(out[g]["ttft_s"]) for g in GROUPS if out[g]["ttft_s"]}
    result = {"cpu": cpu, "machine": platform.machine(), "sessions_per_group": args.sessions,
              "min_context": args.min_context,
              "groups": {g: {k: v for k, v in out[g].items() if k != "text"} | {
                  "ttft_p50_s": p50.get(g)} for g in GROUPS}}
    if "moved, peer fetch" in p50 and "moved, recompute" in p50:
        result["peer_over_recompute"] = p50["moved, peer fetch"] / p50["moved, recompute"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=4, help="sessions per group")
    ap.add_argument("--min-context", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--num-kv-blocks", type=int, default=2048)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from baton.engine.models.loader import resolve_model_dir
    from baton.engine.tokenizer import load_tokenizer
    from tests.redis_server import RedisServer, server_binary

    convs = conversations(load_tokenizer(resolve_model_dir(None)), 3 * args.sessions, 8)
    binary = server_binary()
    if binary is None:
        raise SystemExit("peer_fetch_bench needs valkey-server or redis-server (make setup)")
    logs = Path(tempfile.mkdtemp(prefix="peer-fetch-"))
    redis = RedisServer(binary, logs / "redis.log").start()
    procs: list[subprocess.Popen] = []
    try:
        pods = []
        for i in range(2):
            port = free_port()
            procs.append(start(["serve", "--port", str(port), "--role", "decode",
                                "--registry", redis.url, "--num-threads", "1",
                                "--num-kv-blocks", str(args.num_kv_blocks)],
                               logs / f"decode-{i}.log"))
            pods.append(f"http://127.0.0.1:{port}")
        routers = {}
        for arm, flag in (("peer", "--peer-fetch"), ("recompute", "--no-peer-fetch")):
            port = free_port()
            procs.append(start(["router", "--port", str(port), "--registry", redis.url,
                                "--weights", WEIGHTS, flag], logs / f"router-{arm}.log"))
            routers[arm] = f"http://127.0.0.1:{port}"
        for url, proc in zip([*pods, *routers.values()], procs):
            wait_ready(url, proc, 600)
        time.sleep(2.0)  # the routers see both pods in the registry
        out = asyncio.run(measure(routers, pods, convs, args.min_context, args.max_tokens))
    except BaseException:
        for p in logs.glob("*.log"):
            print(f"--- {p.name}\n{tail(p)}", file=sys.stderr)
        raise
    finally:
        for proc in procs:
            stop_server(proc)
        redis.stop()
    result = report(out, cpu_model(), args)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
