"""Named scenarios: the same workload against local clusters (`baton up`) that differ in one
setting, then the results side by side.

- `static-vs-continuous`: the engine's `static` policy (fixed groups run to completion)
  against continuous batching (`fcfs`).
- `chunk-sweep`: continuous batching with different token budgets per step
  (`--chunk-sizes`); a budget as large as the longest prompt is "chunking off": a long
  prefill then fills whole steps and the running decodes wait (watch ITL p99).
- `colocated-vs-disaggregated`: one colocated worker with all the cores against one prefill
  and one decode worker splitting them (KV over tcp; `--disagg-min-prefill-tokens`).
- `vs-vllm`: goodput at equal SLOs against vLLM's server, a rate sweep of several
  workloads on each system (`vs_vllm.py`; its own flags, no `--workload`).

    python -m benchmarks.scenarios static-vs-continuous --workload loadtest/workloads/chat.yaml \
        --out runs/s
    python -m benchmarks.scenarios vs-vllm --vllm-python /tmp/vllm-venv/bin/python --out runs/vs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from baton_loadtest import report
from baton_loadtest.cli import load_tokenizer, run_command, run_once, workload_args
from baton_loadtest.client import ClientSettings
from baton_loadtest.spec import WorkloadSpec
from benchmarks import vs_vllm
from benchmarks.procs import free_port_run

SCENARIOS = {
    "static-vs-continuous": "the engine's static policy vs continuous batching",
    "chunk-sweep": "continuous batching at several per-step token budgets",
    "colocated-vs-disaggregated": "one colocated worker vs prefill + decode workers",
    "vs-vllm": "goodput at equal SLOs: vLLM's server, Baton colocated, Baton disaggregated",
}


def variants(args) -> list[tuple[str, list[str], dict]]:
    """(name, worker flags, Cluster keyword arguments) per variant."""
    workers = {"num_workers": args.workers}
    if args.scenario == "static-vs-continuous":
        return [("static", ["--scheduling-policy", "static"], workers),
                ("continuous", ["--scheduling-policy", "fcfs"], workers)]
    if args.scenario == "colocated-vs-disaggregated":
        return [("colocated", [], {"num_workers": 1}),
                ("disaggregated", [], {"num_prefill": 1, "num_decode": 1, "router_args": [
                    "--disagg-min-prefill-tokens", str(args.disagg_min_prefill_tokens)]})]
    sizes = [int(x) for x in args.chunk_sizes.split(",")]
    return [(f"budget_{n}", ["--max-num-batched-tokens", str(n)], workers) for n in sizes]


def cmd_scenario(args) -> int:
    from baton.launch import Cluster

    if args.scenario == "vs-vllm":
        return vs_vllm.run(args)
    if args.workload is None:
        raise ValueError(f"scenario {args.scenario} needs --workload")
    spec = WorkloadSpec.load(args.workload).with_overrides(args.num_requests, args.rate,
                                                          args.concurrency)
    tok = load_tokenizer(None)
    slo = report.SLO(args.slo_ttft, args.slo_itl, args.slo_e2e)
    results: list[tuple[str, dict]] = []
    for name, flags, shape in variants(args):
        port = free_port_run(8)
        cluster = Cluster(port=port, worker_args=["--dtype", args.dtype, *flags],
                          log_level="warning", **shape)
        print(f"== {name}: baton up {' '.join(flags)}", flush=True)
        try:
            cluster.start()
            settings = ClientSettings(cluster.router_url, "SmolLM2-135M-Instruct", args.api)
            results.append((name, run_once(spec, tok, settings, slo, args.out / name,
                                           not args.no_progress)))
        finally:
            cluster.stop()
    base_name, base = results[0]
    text = "".join(f"\n### {base_name} vs {name}\n\n" + report.compare(base, s, base_name, name)
                   for name, s in results[1:])
    (Path(args.out) / "compare.md").write_text(text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scenarios", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    workload_args(p, workload_required=False)
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=None)
    load.add_argument("--concurrency", type=int, default=None)
    p.add_argument("--api", choices=["chat", "completions"], default="chat")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunk-sizes", default="64,256,8192",
                   help="chunk-sweep: per-step token budgets")
    p.add_argument("--disagg-min-prefill-tokens", type=int, default=256,
                   help="colocated-vs-disaggregated, vs-vllm: the router's remote-prefill "
                        "threshold")
    vs_vllm.add_arguments(p)
    return run_command(cmd_scenario, p.parse_args(argv), p.prog)


if __name__ == "__main__":
    sys.exit(main())
