"""The planner's subcommands of `baton` (wired in by `baton.cli`):

    baton profile [--quick] [--out profile.yaml]           measure step costs on this machine
    baton plan --profile profile.yaml --rate 4 ...          replicas for an SLO (simulated)
    baton planner --profile ... --metrics-url ... ...       scale the Deployments in a cluster

Each `run` function takes the parsed args and returns the exit code. A ValueError (a bad
flag or profile field) propagates to `baton.cli.main`, which prints it and exits 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading

from baton.cli_common import add_common_flags, add_model_flags, engine_default
from baton.engine.config import DEVICES

log = logging.getLogger(__name__)


def add_subcommands(sub) -> None:
    """Add `profile`, `plan` and `planner` to the `baton` subparsers object `sub`."""
    _profile_parser(sub)
    _plan_parser(sub)
    _planner_parser(sub)


# -- baton profile ------------------------------------------------------------------------
def _profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure the engine's step costs on this machine")
    add_model_flags(p)
    p.add_argument("--device", default=engine_default("device"), choices=DEVICES)
    p.add_argument("--sim-profile", default=None,
                   help="--device sim: the simulated GPU x model to profile (a bundled name "
                        "such as h100-llama3-8b, or a YAML file): a plan for a GPU fleet "
                        "from a laptop (docs/operate.md says how far to trust it)")
    p.add_argument("--max-batch", type=int, default=64,
                   help="largest decode batch measured (grid 1, 4, 16, 64, ...)")
    p.add_argument("--max-context", type=int, default=4096,
                   help="longest decode context measured (grid 128, 1024, 4096)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=engine_default("max_num_batched_tokens"),
                   help="the pods' token budget per step: the largest prefill measured and "
                        "the chunk size the planner simulates")
    p.add_argument("--max-num-seqs", type=int, default=engine_default("max_num_seqs"),
                   help="the pods' largest batch, recorded for the planner")
    p.add_argument("--num-threads", type=int, default=engine_default("num_threads"))
    p.add_argument("--quick", action="store_true",
                   help="a small grid (about a minute on 2 CPU cores with the bundled model)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timings per prefill point, the fastest kept (more on a busy machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="profile.yaml", help="where to write the profile")
    add_common_flags(p, "profile")
    p.set_defaults(run=_profile, parser=p)


def _profile(args) -> int:
    from baton.planner.measure import ProfileSettings, run_profile

    settings = ProfileSettings(
        model=args.model, dtype=args.dtype, device=args.device,
        sim_profile=args.sim_profile, max_batch=args.max_batch,
        max_context=args.max_context, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, num_threads=args.num_threads, quick=args.quick,
        repeats=args.repeats, seed=args.seed)
    profile = run_profile(settings)
    profile.save(args.out)
    pc, dc = profile.prefill, profile.decode
    print(f"prefill_s(tokens) = {pc.a:.4g} + {pc.b:.4g} * tokens + {pc.q:.4g} * "
          "tokens (tokens + 1) / 2   "
          f"(rmse {pc.rmse_s:.3g} s, max error {pc.max_rel_error:.1%}, {len(pc.points)} points)")
    knots = ", ".join(f"{b}: {t:.4g}" for b, t in dc.knots)
    print(f"decode_step_s(batch, ctx_total) = g(batch) + {dc.e:.4g} * ctx_total, g piecewise "
          f"linear through {{{knots}}} s (straight line {dc.c:.4g} + {dc.d:.4g} * batch)   "
          f"(rmse {dc.rmse_s:.3g} s, max error {dc.max_rel_error:.1%}, {len(dc.points)} points)")
    if max(pc.max_rel_error, dc.max_rel_error) > POOR_FIT:
        print(f"warning: a measured point is more than {POOR_FIT:.0%} off its fitted cost: "
              "was something else using this machine? Re-run it idle before planning with "
              "this profile", file=sys.stderr)
    print(f"wrote {args.out}")
    return 0


POOR_FIT = 0.5  # relative error of the worst point above which the profile is suspect


# -- baton plan ---------------------------------------------------------------------------
def _slo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ttft-slo", type=float, default=1.0, help="TTFT target, seconds")
    p.add_argument("--itl-slo", type=float, default=0.05, help="inter-token latency target, s")
    p.add_argument("--percentile", type=float, default=90.0,
                   help="the percentile both targets apply to")


def _workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (lognormal lengths: mean in tokens, sigma of the log)")
    g.add_argument("--prompt-mean", type=float, default=512.0)
    g.add_argument("--prompt-sigma", type=float, default=0.8)
    g.add_argument("--prompt-max", type=int, default=4096)
    g.add_argument("--output-mean", type=float, default=128.0)
    g.add_argument("--output-sigma", type=float, default=0.8)
    g.add_argument("--output-max", type=int, default=1024)
    g.add_argument("--num-requests", type=int, default=2000, help="simulated per candidate")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--transfer-overhead", type=float, default=0.005,
                   help="seconds of KV hand-off per request, added to TTFT")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="decode pods' largest batch (default: the profile's)")
    g.add_argument("--spec-tokens-per-step", type=float, default=1.0,
                   help="speculative decoding: tokens a decoding sequence gains per step "
                        "(1 + accepted guesses; `baton planner` learns it from the pods)")
    g.add_argument("--spec-rows-per-step", type=float, default=1.0,
                   help="speculative decoding: rows a decoding sequence costs a step "
                        "(1 + its guesses)")


def _plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="prefill and decode replicas for an SLO (simulated)")
    p.add_argument("--profile", required=True, help="a profile from `baton profile`")
    p.add_argument("--rate", type=float, required=True, help="requests per second")
    _slo_args(p)
    _workload_args(p)
    p.add_argument("--max-replicas", type=int, default=16, help="prefill + decode at most")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_common_flags(p, "plan")
    p.set_defaults(run=_plan, parser=p)


def _workload(args, rate: float):
    from baton.planner.simulate import LengthDist, Workload

    return Workload(rate,
                    LengthDist(args.prompt_mean, args.prompt_sigma, args.prompt_max, "prompt"),
                    LengthDist(args.output_mean, args.output_sigma, args.output_max, "output"),
                    num_requests=args.num_requests, seed=args.seed)


def _plan_settings(args, max_replicas: int):
    from baton.planner.plan import SLO, PlanSettings
    from baton.planner.speculation import Speculation

    return PlanSettings(SLO(args.ttft_slo, args.itl_slo, args.percentile),
                        max_replicas=max_replicas, transfer_s=args.transfer_overhead,
                        max_num_seqs=args.max_num_seqs,
                        speculation=Speculation(args.spec_tokens_per_step,
                                                args.spec_rows_per_step))


def _plan(args) -> int:
    from baton.planner.plan import PlanError, format_plan, format_rows, plan
    from baton.planner.profile import Profile

    profile = Profile.load(args.profile)
    settings = _plan_settings(args, args.max_replicas)
    try:
        result = plan(profile, _workload(args, args.rate), settings)
    except PlanError as err:
        if args.json:
            print(json.dumps({"error": str(err), "rows": [vars(r) for r in err.rows]}))
        else:
            print(format_rows(err.rows, settings.slo))
        print(f"baton plan: {err}", file=sys.stderr)
        return 1
    print(json.dumps(result.to_json(), indent=2) if args.json else format_plan(result, profile))
    return 0


# -- baton planner ------------------------------------------------------------------------
def _planner_parser(sub) -> None:
    p = sub.add_parser("planner", help="scale the prefill and decode Deployments for an SLO")
    p.add_argument("--namespace", default="default")
    p.add_argument("--prefill-deployment", required=True)
    p.add_argument("--decode-deployment", required=True)
    p.add_argument("--metrics-url", required=True, action="append",
                   help="the routers' /metrics URL; its host is resolved to every address "
                        "behind it (a headless Service: every router pod), each scraped on "
                        "its own; repeat the flag for several")
    p.add_argument("--profile", required=True, help="a profile from `baton profile`")
    p.add_argument("--interval", type=float, default=30.0, help="seconds between rounds")
    _slo_args(p)
    for pool in ("prefill", "decode"):
        p.add_argument(f"--min-{pool}", type=int, default=1)
        p.add_argument(f"--max-{pool}", type=int, default=8)
    p.add_argument("--scale-down-after", type=int, default=3,
                   help="rounds in a row that must ask for fewer replicas before scaling down")
    p.add_argument("--dry-run", action="store_true", help="log decisions, change nothing")
    p.add_argument("--kube-api", default=None,
                   help="API server URL (default: in-cluster config, then kubeconfig)")
    _workload_args(p)
    add_common_flags(p, "planner")
    p.set_defaults(run=_planner, parser=p)


def _planner(args) -> int:
    from baton.planner.base import KubeError
    from baton.planner.kube import KubernetesClient
    from baton.planner.metrics_source import ScrapeSource
    from baton.planner.profile import Profile
    from baton.planner.scaler import Scaler, ScalerConfig, profile_plan_fn

    config = ScalerConfig(args.namespace, args.prefill_deployment, args.decode_deployment,
                          args.interval, args.min_prefill, args.max_prefill, args.min_decode,
                          args.max_decode, args.scale_down_after, args.dry_run)
    profile = Profile.load(args.profile)
    plan_fn = profile_plan_fn(profile, _workload(args, 1.0),
                              _plan_settings(args, args.max_prefill + args.max_decode), config)
    try:
        kube = KubernetesClient(args.kube_api)
    except KubeError as err:
        print(f"baton planner: {err}", file=sys.stderr)
        return 1
    scaler = Scaler(config, kube, ScrapeSource(args.metrics_url), plan_fn)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    log.info("planning every %gs for %s/%s and %s/%s%s", config.interval_s, config.namespace,
             config.prefill_deployment, config.namespace, config.decode_deployment,
             " (dry run)" if config.dry_run else "")
    try:
        scaler.run(stop)
    except KeyboardInterrupt:
        pass
    return 0
