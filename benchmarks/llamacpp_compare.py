"""Baton against llama.cpp's `llama-server` on the bundled model's GGUF file (Q4_1
SmolLM2-135M-Instruct), the same thread count on both sides (issue 39): batch-1 decode
tokens/s, aggregate tokens/s at 16 concurrent streams, and perplexity on a fixed text.

    python -m benchmarks.llamacpp_compare --llama-cpp BUILD [--threads 2] [--rounds 3]
        [--tokens 256] [--streams 16] [--ppl-ctx 512] [--json out.json]

BUILD is a llama.cpp build directory holding `bin/llama-server` and `bin/llama-perplexity`
(`benchmarks/build_llamacpp.sh DIR` makes DIR/build; or set $LLAMA_CPP_BUILD).

Both servers run at once, idle while the other is measured: `baton serve --quantization
auto --num-threads T` and `llama-server --threads T --threads-batch T --parallel 16` (its
context 16 x 512 tokens, continuous batching on). Each round measures one side then the
other, the order alternating between rounds, so a load that comes and goes on a shared
machine hits both; the ratios are read per round. Requests are OpenAI completions, greedy,
`ignore_eos` with `max_tokens` = --tokens.
- batch-1 decode: one streamed request at a time (3 per round, the median); decode tokens/s
  = (completion tokens - 1) / (time of the last content event - time of the first), so the
  prefill and the first token's latency are not in it.
- 16 streams: 16 concurrent non-streamed requests (distinct prompts); aggregate tokens/s =
  all completion tokens / the wall time from sending the first to the last answer.

Perplexity: `llama-perplexity -c N` (N = --ppl-ctx, its default 512) on
benchmarks/data/gpl-3.0.txt (the GNU GPL v3 text as shipped in numpy's wheel,
numpy-2.4.6.dist-info/licenses/LICENSE.txt; verbatim copies are permitted; ~7.7k tokens).
llama-perplexity drops one trailing newline, tokenizes the text once (with BOS if the vocab
adds one), cuts it into floor(len / N) windows of N tokens (the first token of each replaced
by BOS when the vocab adds one), evaluates each window from an empty cache and scores only
its second half: the logits at positions N/2 .. N-2 against the tokens at N/2+1 .. N-1, N/2-1
tokens per window; PPL = exp(mean negative log-likelihood) over all scored tokens. Baton
computes exactly that: the windows are built from llama-server's own `/tokenize` of the
same text (so both score the same token ids), each sent as a token-id prompt with `echo` and
`logprobs`, whose prompt logprobs are log p(token i | tokens < i) within the window; the
same positions are summed. A prefix-cache hit would leave positions without logprobs; the
script refuses such an answer. Whether Baton's own tokenizer gives the same ids is printed.

Targets: batch-1 decode >= 1.0x llama.cpp, 16 streams >= 2.0x, perplexity within 1%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from benchmarks.procs import free_port_run, sse_events, wait_ready
from benchmarks.quantized import cpu_flags

TEXT = Path(__file__).parent / "data" / "gpl-3.0.txt"
PROMPT = "Once upon a time, in a small village by the sea, there lived an old lighthouse keeper"
SLOT_CTX = 512  # llama-server's context per slot: the prompt and --tokens fit
TIMEOUT = aiohttp.ClientTimeout(total=1800)


def llama_binaries(build: str | None) -> tuple[Path, Path]:
    """(llama-server, llama-perplexity) under BUILD/bin or BUILD/build/bin; exits naming
    what is missing and how to build it."""
    if not build:
        sys.exit("llamacpp_compare: give the llama.cpp build directory (--llama-cpp DIR or "
                 "$LLAMA_CPP_BUILD); build one with benchmarks/build_llamacpp.sh DIR")
    for bindir in (Path(build) / "bin", Path(build) / "build" / "bin"):
        server, ppl = bindir / "llama-server", bindir / "llama-perplexity"
        if server.is_file() and ppl.is_file():
            return server, ppl
    sys.exit(f"llamacpp_compare: no bin/llama-server and bin/llama-perplexity under {build} "
             "(nor under its build/); build them with benchmarks/build_llamacpp.sh DIR")


def start_baton(gguf: Path, port: int, threads: int, streams: int
                ) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "baton.cli", "serve", "--port", str(port),
                             "--model", str(gguf), "--quantization", "auto",
                             "--num-threads", str(threads), "--max-num-seqs", str(streams),
                             "--log-level", "warning"])
    return proc, f"http://127.0.0.1:{port}"


def start_llama(server: Path, gguf: Path, port: int, threads: int, streams: int
                ) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([str(server), "-m", str(gguf), "--host", "127.0.0.1",
                             "--port", str(port), "--threads", str(threads),
                             "--threads-batch", str(threads), "--parallel", str(streams),
                             "-c", str(streams * SLOT_CTX), "--cont-batching", "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {await resp.text()}")
        return await resp.json()


async def model_name(url: str) -> str:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.get(url + "/v1/models") as resp:
            body = await resp.json()
            if "data" not in body:
                raise RuntimeError(f"{url}/v1/models: {body}")
            return body["data"][0]["id"]


def _body(model: str, prompt: str | list[int], tokens: int, stream: bool) -> dict:
    body: dict[str, object] = {"model": model, "prompt": prompt, "max_tokens": tokens,
                               "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def decode_rate(url: str, model: str, tokens: int) -> float:
    """One streamed request: (completion tokens - 1) / (last content event - first)."""
    first = last = 0.0
    n = 0
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.post(url + "/v1/completions",
                                json=_body(model, PROMPT, tokens, True)) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{url}: HTTP {resp.status}: {await resp.text()}")
            async for event in sse_events(resp):
                if event.get("usage"):
                    n = event["usage"]["completion_tokens"]
                if any(c.get("text") for c in event.get("choices") or ()):
                    last = time.perf_counter()
                    first = first or last
    if n != tokens:
        raise RuntimeError(f"{url}: got {n} tokens, asked {tokens} (ignore_eos not honoured?)")
    return (n - 1) / (last - first)


async def aggregate_rate(url: str, model: str, tokens: int, streams: int) -> float:
    """`streams` concurrent requests: all completion tokens / wall time."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=TIMEOUT) as session:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(
            _post(session, url + "/v1/completions",
                  _body(model, f"Story {i}. {PROMPT}", tokens, False))
            for i in range(streams)))
        elapsed = time.perf_counter() - t0
    n = sum(o["usage"]["completion_tokens"] for o in outs)
    if n != tokens * streams:
        raise RuntimeError(f"{url}: got {n} tokens, asked {tokens * streams}")
    return n / elapsed


def measure(url: str, model: str, args: argparse.Namespace) -> tuple[float, float]:
    """(batch-1 decode tokens/s, the median of 3; aggregate tokens/s at --streams)."""
    b1 = statistics.median(asyncio.run(decode_rate(url, model, args.tokens)) for _ in range(3))
    return b1, asyncio.run(aggregate_rate(url, model, args.tokens, args.streams))


@dataclass
class Round:
    order: list[str]
    rates: dict[str, tuple[float, float]]  # side -> (batch-1 decode, aggregate) tokens/s

    def ratio(self, i: int) -> float:
        return self.rates["baton"][i] / self.rates["llama.cpp"][i]


def ab_rounds(servers: dict[str, tuple[str, str]], args: argparse.Namespace) -> list[Round]:
    """Alternating rounds, each printed as it comes."""
    for url, model in servers.values():  # warm up both: first steps, allocations
        asyncio.run(decode_rate(url, model, 16))
        asyncio.run(aggregate_rate(url, model, 16, args.streams))
    rounds = []
    for r in range(args.rounds):
        order = list(servers) if r % 2 == 0 else list(servers)[::-1]
        point = Round(order, {side: measure(*servers[side], args) for side in order})
        rounds.append(point)
        baton, llama = point.rates["baton"], point.rates["llama.cpp"]
        print(f"round {r + 1} ({' then '.join(order)}): batch-1 decode baton {baton[0]:6.1f} "
              f"llama.cpp {llama[0]:6.1f} tok/s ({point.ratio(0):.2f}x); {args.streams} streams "
              f"baton {baton[1]:7.1f} llama.cpp {llama[1]:7.1f} tok/s ({point.ratio(1):.2f}x); "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
    return rounds


def ppl_text() -> str:
    text = TEXT.read_text()
    return text[:-1] if text.endswith("\n") else text  # as llama-perplexity's -f reads it


def llama_perplexity(binary: Path, gguf: Path, threads: int, n_ctx: int) -> float:
    out = subprocess.run([str(binary), "-m", str(gguf), "-f", str(TEXT), "-c", str(n_ctx),
                          "--threads", str(threads), "--threads-batch", str(threads)],
                         capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if not found:
        raise RuntimeError("llama-perplexity printed no final estimate:\n" + out.stderr[-3000:])
    return float(found.group(1))


async def llama_tokens(url: str, text: str) -> tuple[list[int], int | None]:
    """llama.cpp's tokenization of `text` as llama-perplexity does it (special tokens added,
    not parsed), and its BOS id when the vocab adds one (None otherwise)."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        body = {"add_special": True, "parse_special": False}
        ids = (await _post(session, url + "/tokenize", body | {"content": text}))["tokens"]
        empty = (await _post(session, url + "/tokenize", body | {"content": ""}))["tokens"]
    return ids, (empty[0] if empty else None)


async def baton_perplexity(url: str, model: str, ids: list[int], bos: int | None,
                           n_ctx: int) -> float:
    """llama-perplexity's windows and scored positions, from Baton's prompt logprobs."""
    first, nll, count = n_ctx // 2, 0.0, 0
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        for c in range(len(ids) // n_ctx):
            window = ids[c * n_ctx:(c + 1) * n_ctx]
            if bos is not None:
                window[0] = bos
            body = _body(model, window, 1, False) | {"echo": True, "logprobs": 0}
            out = await _post(session, url + "/v1/completions", body)
            lps = out["choices"][0]["logprobs"]["token_logprobs"][:n_ctx]
            scored = lps[first + 1:n_ctx]
            if len(lps) != n_ctx or any(lp is None for lp in scored):
                raise RuntimeError(f"window {c}: prompt logprobs missing (a prefix-cache hit?)")
            nll -= sum(scored)
            count += len(scored)
    return math.exp(nll / count)


async def baton_agrees(url: str, model: str, text: str, ids: list[int]) -> str:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        mine = (await _post(session, url + "/tokenize", {"model": model, "prompt": text,
                                                         "add_special_tokens": True}))["tokens"]
    if mine == ids:
        return f"same {len(ids)} token ids"
    same = next((i for i, (a, b) in enumerate(zip(mine, ids)) if a != b), min(len(mine),
                                                                              len(ids)))
    return f"differs: Baton {len(mine)} ids, llama.cpp {len(ids)}, first difference at {same}"


def perplexities(servers: dict[str, tuple[str, str]], binary: Path, gguf: Path,
                 args: argparse.Namespace) -> dict:
    text = ppl_text()
    ids, bos = asyncio.run(llama_tokens(servers["llama.cpp"][0], text))
    url, model = servers["baton"]
    result = {"tokens": len(ids), "windows": len(ids) // args.ppl_ctx,
              "tokenizers": asyncio.run(baton_agrees(url, model, text, ids)),
              "llama.cpp": llama_perplexity(binary, gguf, args.threads, args.ppl_ctx),
              "baton": asyncio.run(baton_perplexity(url, model, ids, bos, args.ppl_ctx))}
    result["rel_diff"] = result["baton"] / result["llama.cpp"] - 1
    return result


def report(rounds: list[Round], ppl: dict, args: argparse.Namespace) -> None:
    def med(side: str, i: int) -> float:
        return statistics.median(r.rates[side][i] for r in rounds)

    b1 = [r.ratio(0) for r in rounds]
    agg = [r.ratio(1) for r in rounds]
    print(f"\n| {args.threads} threads | Baton | llama.cpp | ratio (per round) | target |")
    print("|---|---:|---:|---|---|")
    print(f"| batch-1 decode tok/s | {med('baton', 0):.1f} | {med('llama.cpp', 0):.1f} | "
          f"{statistics.median(b1):.2f}x ({', '.join(f'{x:.2f}' for x in b1)}) | >= 1.0x: "
          f"{'met' if statistics.median(b1) >= 1.0 else 'NOT met'} |")
    print(f"| {args.streams} streams tok/s | {med('baton', 1):.1f} | {med('llama.cpp', 1):.1f} | "
          f"{statistics.median(agg):.2f}x ({', '.join(f'{x:.2f}' for x in agg)}) | >= 2.0x: "
          f"{'met' if statistics.median(agg) >= 2.0 else 'NOT met'} |")
    print(f"| perplexity (ctx {args.ppl_ctx}, {ppl['windows']} windows) | {ppl['baton']:.4f} | "
          f"{ppl['llama.cpp']:.4f} | {100 * ppl['rel_diff']:+.2f}% | within 1%: "
          f"{'met' if abs(ppl['rel_diff']) <= 0.01 else 'NOT met'} |")
    print(f"perplexity text: {TEXT.name}, {ppl['tokens']} llama.cpp tokens; Baton's tokenizer: "
          f"{ppl['tokenizers']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP_BUILD"),
                        help="llama.cpp build directory (default: $LLAMA_CPP_BUILD)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--ppl-ctx", type=int, default=512)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    server_bin, ppl_bin = llama_binaries(args.llama_cpp)
    from baton.engine.models.loader import bundled_gguf_path

    gguf = Path(bundled_gguf_path())
    print(f"CPU: {cpu_flags()}; {os.cpu_count()} cores; {gguf.name}; {args.threads} threads",
          flush=True)
    port = free_port_run(2)  # two distinct ports before either server binds its own
    procs = {"baton": start_baton(gguf, port, args.threads, args.streams),
             "llama.cpp": start_llama(server_bin, gguf, port + 1, args.threads, args.streams)}
    try:
        for name, (proc, url) in procs.items():
            wait_ready(url, proc, 600, probe="/ready" if name == "baton" else "/health")
        servers = {name: (url, asyncio.run(model_name(url))) for name, (_, url) in procs.items()}
        rounds = ab_rounds(servers, args)
        ppl = perplexities(servers, ppl_bin, gguf, args)
    finally:
        for proc, _ in procs.values():
            proc.terminate()
        for proc, _ in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    report(rounds, ppl, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": [asdict(r) for r in rounds],
                                               "perplexity": ppl}, indent=2))


if __name__ == "__main__":
    main()
