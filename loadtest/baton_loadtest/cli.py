"""`baton-loadtest`: replay a workload against any OpenAI-compatible endpoint.

    baton-loadtest run --base-url http://127.0.0.1:8000 --workload loadtest/workloads/chat.yaml --out runs/a
    baton-loadtest sweep --base-url URL --workload chat.yaml --rates 1,2,4,8 --slo-ttft 2 --slo-itl 0.2 --out runs/sweep
    baton-loadtest compare runs/a/result.json runs/b/result.json

Baton's own benchmarks built on it (scenarios against local clusters, vs vLLM, the planner
check) live in the repository's `benchmarks/`, not in this package.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from baton_loadtest import report
from baton_loadtest.client import ClientSettings
from baton_loadtest.generator import plan
from baton_loadtest.runner import run_plan
from baton_loadtest.spec import SpecError, WorkloadSpec

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def load_tokenizer(name_or_path: str | None):
    from transformers import AutoTokenizer

    if name_or_path is None:
        from baton.engine.models.loader import resolve_model_dir

        name_or_path = str(resolve_model_dir(None))
    return AutoTokenizer.from_pretrained(name_or_path)


def run_once(spec: WorkloadSpec, tokenizer, settings: ClientSettings, slo: report.SLO,
             out: Path | None, progress: bool = True) -> dict:
    reqs, factory = plan(spec, tokenizer)
    records, wall = asyncio.run(run_plan(spec, reqs, factory, settings, progress))
    offered = spec.arrival.rate if spec.arrival.process in ("poisson", "gamma") else None
    summary = report.summarize(records, wall, slo, offered)
    if out is not None:
        meta = {"workload": spec.name, "base_url": settings.base_url, "model": settings.model,
                "api": settings.api, "arrival": spec.arrival.__dict__ | {
                    "rates": list(spec.arrival.rates)}, "seed": spec.seed}
        report.write_result(out, meta, records, summary)
    return summary


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--tokenizer", default=None, help="HF name or path (default: bundled)")
    p.add_argument("--api", choices=["chat", "completions"], default="chat")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos (for servers that reject it)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0)


def workload_args(p: argparse.ArgumentParser, out_required: bool = True,
                   workload_required: bool = True) -> None:
    p.add_argument("--workload", required=workload_required,
                   help="a YAML file (see loadtest/workloads)")
    p.add_argument("--out", required=out_required, type=Path)
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--slo-ttft", type=float, default=None, help="seconds")
    p.add_argument("--slo-itl", type=float, default=None, help="seconds")
    p.add_argument("--slo-e2e", type=float, default=None, help="seconds")
    p.add_argument("--no-progress", action="store_true")


def _settings(args) -> ClientSettings:
    return ClientSettings(args.base_url, args.model, args.api, not args.no_ignore_eos,
                          args.temperature, args.timeout)


def _slo(args) -> report.SLO:
    return report.SLO(args.slo_ttft, args.slo_itl, args.slo_e2e)


def cmd_run(args) -> int:
    spec = WorkloadSpec.load(args.workload).with_overrides(args.num_requests, args.rate,
                                                          args.concurrency)
    summary = run_once(spec, load_tokenizer(args.tokenizer), _settings(args), _slo(args),
                       args.out, not args.no_progress)
    print((args.out / "summary.md").read_text())
    return 0 if summary["ok"] else 1


def cmd_sweep(args) -> int:
    """Open-loop Poisson at each rate; then bisect between the last passing and the first
    failing rate `--refine` times. Passing: goodput >= `--target` of the offered rate,
    judged as the fraction of the offered requests that met the SLOs (a finite run's wall
    time includes the tail of the last requests, which would bias good/wall low)."""
    base = WorkloadSpec.load(args.workload).with_overrides(args.num_requests)
    tok = load_tokenizer(args.tokenizer)
    rows: list[dict] = []

    def at(rate: float) -> bool:
        spec = base.with_overrides(rate=rate)
        s = run_once(spec, tok, _settings(args), _slo(args), args.out / f"rate_{rate:g}",
                     not args.no_progress)
        s["offered_rate"] = rate
        rows.append(s)
        ok = s["goodput_ratio"] >= args.target
        print(f"rate {rate:g} req/s: throughput {s['request_throughput']:.2f}, goodput "
              f"{s['goodput']:.2f} ({'pass' if ok else 'fail'})", flush=True)
        return ok

    rates = sorted(float(r) for r in args.rates.split(","))
    passing, failing = None, None
    for r in rates:
        if at(r):
            passing = r
        else:
            failing = r
            break
    for _ in range(args.refine if passing is not None and failing is not None else 0):
        mid = (passing + failing) / 2
        if at(mid):
            passing = mid
        else:
            failing = mid
    rows.sort(key=lambda r: r["offered_rate"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.json").write_text(json.dumps(
        {"max_good_rate": passing, "target": args.target, "rows": rows}, indent=1))
    report.plot_sweep(rows, args.out / "sweep.png", args.target)
    print(f"highest rate with goodput >= {args.target:.0%} of offered: "
          f"{passing if passing is not None else 'none of the rates tried'}")
    return 0


def cmd_compare(args) -> int:
    a, b = report.load_result(args.a), report.load_result(args.b)
    print(report.compare(a["summary"], b["summary"], args.name_a or Path(args.a).parent.name,
                         args.name_b or Path(args.b).parent.name))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="baton-loadtest", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one run of a workload")
    _client_args(run)
    workload_args(run)
    load = run.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=None, help="open-loop req/s")
    load.add_argument("--concurrency", type=int, default=None, help="closed-loop clients")
    run.set_defaults(fn=cmd_run)

    sweep = sub.add_parser("sweep", help="find the highest rate meeting the SLOs")
    _client_args(sweep)
    workload_args(sweep)
    sweep.add_argument("--rates", required=True, help="comma-separated req/s")
    sweep.add_argument("--target", type=float, default=0.9)
    sweep.add_argument("--refine", type=int, default=0, help="bisection steps")
    sweep.set_defaults(fn=cmd_sweep)

    cmp_ = sub.add_parser("compare", help="two result.json side by side")
    cmp_.add_argument("a")
    cmp_.add_argument("b")
    cmp_.add_argument("--name-a", default=None)
    cmp_.add_argument("--name-b", default=None)
    cmp_.set_defaults(fn=cmd_compare)

    args = ap.parse_args(argv)
    return run_command(args.fn, args, ap.prog)


def run_command(fn, args: argparse.Namespace, prog: str) -> int:
    """fn(args); a bad workload, value or path is one line on stderr and exit status 2."""
    try:
        return fn(args)
    except (SpecError, ValueError, FileNotFoundError) as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
