"""Speculative decoding through a disaggregated cluster: `baton up --prefill 1 --decode 1`
with and without `--speculative-config` (n-gram; the decode pod speculates, the prefill pod
hands over as usual), both clusters up at once and their runs alternating, so a load that
comes and goes on a shared machine hits both. The same requests as `spec_bench` (the
input-grounded workload, then the chat mix; greedy, token-id prompts), sent `--batch` at a
time as streaming completions; output tokens/s over each batch of runs, the ratio, and the
requests whose texts differ between the clusters.

    python -m benchmarks.spec_serving [--requests 12] [--batches 1,4] [--k 4] [--repeats 2]
        [--out result.json]

Compare the ratios with `spec_bench`'s offline ones (same requests, same k).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

import aiohttp

from benchmarks.procs import free_port_run, wait_ready

MODEL = "SmolLM2-135M-Instruct"


def _requests(workload: str, n: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) of spec_bench's requests."""
    from baton.engine.models.loader import resolve_model_dir
    from baton.engine.tokenizer import load_tokenizer
    from benchmarks.spec_bench import _prompts

    class Tokenizer:  # what _prompts asks of an LLM
        def get_tokenizer(self):
            return load_tokenizer(resolve_model_dir(None))

    prompts, max_tokens = _prompts(Tokenizer(), workload, n)
    return [(p["prompt_token_ids"], m) for p, m in zip(prompts, max_tokens)]


def _start(spec: dict | None) -> tuple[subprocess.Popen, str]:
    port = free_port_run(4)
    cmd = [sys.executable, "-m", "baton.cli", "up", "--port", str(port), "--prefill", "1",
           "--decode", "1", "--disagg-min-prefill-tokens", "1", "--dtype", "bfloat16",
           "--log-level", "warning"]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    proc = subprocess.Popen(cmd)
    return proc, f"http://127.0.0.1:{port}"


async def _one(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
               ) -> tuple[str, int]:
    """The streamed text and its completion tokens (the usage chunk)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    text, tokens = [], 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text += [c.get("text", "") for c in chunk.get("choices", [])]
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return "".join(text), tokens


async def _batch(url: str, reqs: list[tuple[list[int], int]], batch: int
                 ) -> tuple[float, list[tuple[str, int]]]:
    """Seconds for every request, `batch` at a time, and their (text, tokens)."""
    timeout = aiohttp.ClientTimeout(total=1800)
    outs: list[tuple[str, int]] = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        for i in range(0, len(reqs), batch):
            outs += await asyncio.gather(*(_one(session, url, p, m)
                                           for p, m in reqs[i:i + batch]))
    return time.perf_counter() - t0, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    spec = {"method": "ngram", "num_speculative_tokens": args.k,
            "disable_by_batch_size": max(batches)}
    clusters = {"plain": _start(None), "spec": _start(spec)}
    result: dict = {}
    try:
        for proc, url in clusters.values():
            wait_ready(url, proc, 600)
        for workload in ("grounded", "chat"):
            reqs = _requests(workload, args.requests)
            for _, url in clusters.values():  # warm up: first steps, the KV connection
                asyncio.run(_batch(url, reqs[:2], 2))
            for batch in batches:
                point: dict = {"plain": 0.0, "spec": 0.0}
                texts: dict[str, list[str]] = {}
                for _ in range(args.repeats):
                    for name, (_, url) in clusters.items():
                        elapsed, outs = asyncio.run(_batch(url, reqs, batch))
                        point[name] = max(point[name], sum(n for _, n in outs) / elapsed)
                        texts[name] = [t for t, _ in outs]
                point["ratio"] = point["spec"] / point["plain"]
                point["mismatches"] = sum(a != b for a, b in zip(texts["plain"],
                                                                 texts["spec"]))
                result[f"{workload}_b{batch}"] = point
                print(f"{workload}_b{batch:<3}: plain {point['plain']:7.1f} tok/s  ngram "
                      f"{point['spec']:7.1f} tok/s  ratio {point['ratio']:.2f}x  "
                      f"mismatched requests {point['mismatches']}", flush=True)
    finally:
        for proc, _ in clusters.values():
            proc.terminate()
        for proc, _ in clusters.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
