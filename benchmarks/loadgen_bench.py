"""How fast is the load generator itself? Streams against a trivial local endpoint (the
simulated worker: a few tokens, no delay) so the client is the only thing measured.

Reports closed-loop throughput at 64 clients and, open loop, whether a target rate is held:
achieved rate and how late requests left versus their planned send times (p50/p99).

    python -m benchmarks.loadgen_bench [--requests 5000] [--rate 500]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import numpy as np

from baton_loadtest.cli import load_tokenizer
from baton_loadtest.client import ClientSettings
from baton_loadtest.generator import plan
from baton_loadtest.runner import run_plan
from baton_loadtest.spec import ArrivalSpec, LengthSpec, WorkloadSpec
from benchmarks.procs import free_port, wait_ready


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--rate", type=float, default=500.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4)
    args = ap.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sim_cpus = {cpus[0]} if len(cpus) > 1 else None
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.sim_worker", "--port", str(port),
         "--tokens", str(args.tokens), "--itl", "0"],
        preexec_fn=(lambda: os.sched_setaffinity(0, sim_cpus)) if sim_cpus else None)
    if len(cpus) > 1:
        os.sched_setaffinity(0, set(cpus[1:]))  # the generator on the other core(s)
    try:
        wait_ready(url, proc, 30)
        settings = ClientSettings(url, "sim", "completions")
        base = WorkloadSpec(num_requests=args.requests, prompt_tokens=LengthSpec(value=32),
                            output_tokens=LengthSpec(value=args.tokens))
        tok = load_tokenizer(None)
        for name, arrival in (("closed", ArrivalSpec(process="closed",
                                                     concurrency=args.concurrency)),
                              ("open", ArrivalSpec(process="poisson", rate=args.rate))):
            spec = WorkloadSpec(**{**base.__dict__, "arrival": arrival})
            reqs, factory = plan(spec, tok)
            records, wall = asyncio.run(run_plan(spec, reqs, factory, settings, False))
            ok = sum(r.ok for r in records)
            line = (f"{name:6s}: {ok}/{len(records)} ok, {ok / wall:7.1f} streaming req/s "
                    f"({args.tokens} chunks each)")
            if name == "open":
                lag = np.asarray([rec.sent_s - req.arrival_s for rec, req in
                                  zip(records, sorted(reqs, key=lambda r: r.index))])
                line += (f" at offered {args.rate:g}/s; send lag p50 {1e3 * np.median(lag):.2f}"
                         f" ms, p99 {1e3 * np.percentile(lag, 99):.2f} ms")
            else:
                line += f" with {args.concurrency} clients"
            print(line, flush=True)
            time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
