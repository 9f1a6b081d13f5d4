"""The planner checked against measured runs: profile, plan, serve, compare.

    python -m benchmarks.planner_check --workload loadtest/workloads/chat.yaml --rate 0.3 \\
        --ttft-slo 5 --itl-slo 0.2 --out runs/planner_chat [--profile profile.yaml] \\
        [--num-requests 20] [--record tests/unit/planner/fixtures/chat_1p1d_e.json]

1. `baton profile --quick` with one thread pinned to core 0 (unless `--profile` is given):
   every pod here gets one core, so the profile describes a one-core pod.
2. `baton plan` (the library call) for the very requests the load test will send (their
   arrival times and token counts, chat template included), the SLOs at p90, and at most
   as many replicas as this machine has cores, one core each.
3. The recommended P:D is started with `baton.launch.Cluster` (prefill pods pinned to the
   first cores, decode pods to the next, one thread each, KV over tcp, every prompt
   prefilled remotely), and the workload is driven through its router; the router and this
   client run on `--harness-cpu`.
4. The configuration with one replica fewer: on a machine of two cores "one fewer of each"
   of 1P:1D is no pod at all, so the alternative is one colocated worker with both cores
   (one replica fewer in all, the same hardware). The planner does not simulate colocated
   pods; its row is measured only, to see whether the SLO the plan needed two pods for is
   really missed with one.
5. The simulation replays the measured requests (arrival, prompt and output tokens from the
   load tester's records) on the recommended P:D, once with pods that have their cores to
   themselves and once with each pool slowed by the CPU share its threads got while
   runnable during the run (the kernel's run-queue accounting, /proc/<pid>/task/*/schedstat:
   on a machine shared with other work a pod does not get its core). The report gives both
   predictions, the measured p90 TTFT and ITL and the relative error (target: within 15%),
   as `report.json` and `report.md`; `--record` saves the run as a `RecordedRun` fixture
   that tests/unit/planner/test_recorded.py replays.

Re-record the suite's newest fixture (about 5 minutes on two cores; longer on a busy machine;
TTFT 5 s because one core prefills chat's p90 prompt in about 2.5 s before any queueing):

    python -m benchmarks.planner_check --workload loadtest/workloads/chat.yaml --rate 0.3 \
        --num-requests 20 --ttft-slo 5 --itl-slo 0.2 --out runs/planner_chat \
        --record tests/unit/planner/fixtures/chat_1p1d_e.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from baton_loadtest import report
from baton_loadtest.cli import load_tokenizer, run_command, run_once
from baton_loadtest.client import ClientSettings, RequestRecord
from baton_loadtest.generator import PlannedRequest
from baton_loadtest.generator import plan as plan_requests
from baton_loadtest.spec import WorkloadSpec
from benchmarks.interference_bench import pin_process
from benchmarks.procs import free_port_run

MODEL = "SmolLM2-135M-Instruct"
TOLERANCE = 0.15  # the target for predicted vs measured p90


@dataclass(frozen=True)
class Variant:
    name: str
    prefill: int  # 0: colocated
    decode: int  # colocated: the number of workers
    threads: int  # per worker

    @property
    def label(self) -> str:
        if self.prefill:
            return f"{self.prefill}P:{self.decode}D, {self.threads} thread(s) per pod"
        return f"{self.decode} colocated worker(s), {self.threads} thread(s) each"


# -- the planner's side -------------------------------------------------------------------
def measure_profile(args, out: Path) -> Path:
    """`baton profile --quick`, one thread pinned to core 0: a one-core pod's costs."""
    path = out / "profile.yaml"
    cmd = [sys.executable, "-m", "baton.cli", "profile", "--quick", "--num-threads", "1",
           "--dtype", args.dtype, "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-num-seqs", str(args.max_num_seqs), "--max-batch", "16",
           "--max-context", "1024", "--repeats", "5", "--out", str(path)]
    print(f"== profile: {' '.join(cmd[2:])} (pinned to core 0)", flush=True)
    subprocess.run(cmd, check=True, preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    return path


def prompt_tokens(req: PlannedRequest, tokenizer, api: str) -> int:
    """The prompt as the worker will see it: chat template included."""
    if api == "chat":
        ids = tokenizer.apply_chat_template(req.messages, add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
        return len(ids)
    return len(tokenizer.encode(req.prompt))


def planned_trace(reqs: list[PlannedRequest], tokenizer, api: str):
    from baton.planner.simulate import Trace

    reqs = sorted(reqs, key=lambda r: r.arrival_s)
    return Trace(np.array([r.arrival_s for r in reqs], float),
                 np.array([prompt_tokens(r, tokenizer, api) for r in reqs], np.int64),
                 np.array([r.max_tokens for r in reqs], np.int64))


def measured_trace(records: list[RequestRecord]):
    """The requests as they were sent and served: send time, prompt and output tokens."""
    from baton.planner.simulate import Trace

    ok = sorted((r for r in records if r.ok and r.prompt_tokens), key=lambda r: r.sent_s)
    if not ok:
        raise RuntimeError("no request succeeded: nothing to compare the planner with")
    return Trace(np.array([r.sent_s for r in ok], float),
                 np.array([r.prompt_tokens for r in ok], np.int64),
                 np.array([max(r.output_tokens or 1, 1) for r in ok], np.int64))


def workload_of(trace, rate: float):
    """The planner's lognormal summary of a trace (for the plan's printout)."""
    from baton.planner.simulate import LengthDist, Workload

    def dist(values: np.ndarray, name: str) -> LengthDist:
        sigma = float(np.std(np.log(values))) if values.size > 1 else 0.0
        return LengthDist(float(values.mean()), min(sigma, 4.0), int(values.max()), name)

    return Workload(rate, dist(trace.prompt, "prompt"), dist(trace.output, "output"),
                    num_requests=max(10, len(trace.prompt)))


def make_plan(profile, trace, args, cores: int):
    from baton.planner.plan import SLO, PlanSettings, plan

    settings = PlanSettings(SLO(args.ttft_slo, args.itl_slo, 90.0), max_replicas=cores,
                            transfer_s=args.transfer_overhead,
                            max_num_seqs=args.max_num_seqs)
    return plan(profile, workload_of(trace, args.rate or 1.0), settings, trace)


# -- the measured side --------------------------------------------------------------------
def run_variant(v: Variant, spec: WorkloadSpec, tokenizer, args
                ) -> tuple[dict, list[RequestRecord], dict[str, float]]:
    """The run's summary, its records, and each pool's measured CPU share (`cpu_share`)."""
    from baton.launch import Cluster

    worker_args = ["--dtype", args.dtype, "--num-threads", str(v.threads),
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                   "--max-num-seqs", str(args.max_num_seqs)]
    if v.prefill:
        shape = {"num_prefill": v.prefill, "num_decode": v.decode,
                 "router_args": ["--disagg-min-prefill-tokens", "1"]}
        worker_args += ["--kv-transport", "tcp"]
    else:
        shape = {"num_workers": v.decode}
    cluster = Cluster(port=free_port_run(v.prefill + v.decode + 2), log_level="warning",
                      worker_args=worker_args, **shape)
    here = os.sched_getaffinity(0)
    out = args.out / v.name
    print(f"== {v.name}: {v.label}", flush=True)
    try:
        cluster.start()
        if v.prefill:
            _pin_pods(cluster, v, args.harness_cpu)
        settings = ClientSettings(cluster.router_url, MODEL, args.api)
        slo = report.SLO(args.ttft_slo, args.itl_slo)
        pools = _pools(cluster)
        before = {role: [runqueue_times(pid) for pid in pids] for role, pids in pools.items()}
        summary = run_once(spec, tokenizer, settings, slo, out, not args.no_progress)
        shares = {role: cpu_share(before[role], [runqueue_times(pid) for pid in pids])
                  for role, pids in pools.items()}
    finally:
        os.sched_setaffinity(0, here)
        cluster.stop()
    records = [RequestRecord.from_dict(r) for r in report.load_result(out / "result.json")[
        "requests"]]
    return summary, records, shares


def _pools(cluster) -> dict[str, list[int]]:
    pools: dict[str, list[int]] = {}
    for child in cluster.procs:
        role = child.name.split("-")[0]
        if role != "router":
            pools.setdefault(role, []).append(child.proc.pid)
    return pools


def runqueue_times(pid: int) -> dict[int, tuple[int, int]]:
    """Per thread of `pid`: (ns run on a CPU, ns runnable but waiting for one), from the
    kernel's /proc/<pid>/task/<tid>/schedstat."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            on_cpu, waiting, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        out[int(tid)] = (int(on_cpu), int(waiting))
    return out


def cpu_share(before: list[dict], after: list[dict]) -> float:
    """The fraction of the time a pool's threads were runnable that they ran: 1 when they
    had their cores to themselves. Other work on those cores (other processes, the router
    and client beside a pod, or the pod's own threads competing for one core) lowers it."""
    ran = waited = 0
    for b, a in zip(before, after):
        for tid, (on_cpu, waiting) in a.items():
            on0, wait0 = b.get(tid, (0, 0))
            ran, waited = ran + on_cpu - on0, waited + waiting - wait0
    return ran / (ran + waited) if ran > 0 else 1.0


def _pin_pods(cluster, v: Variant, harness_cpu: int) -> None:
    """Prefill pods on cores 0.., decode pods on the next ones; router and client on
    `harness_cpu` (they stand in for other machines)."""
    cores = {"prefill": iter(range(v.prefill)),
             "decode": iter(range(v.prefill, v.prefill + v.decode))}
    for child in cluster.procs:
        role = child.name.split("-")[0]
        pin_process(child.proc.pid, {next(cores[role])} if role in cores else {harness_cpu})
    os.sched_setaffinity(0, {harness_cpu})


def p90(summary: dict, key: str) -> float | None:
    return summary[key].get("p90")


# -- comparison and report ----------------------------------------------------------------
def recorded_run(name: str, profile, v: Variant, records, summary: dict, shares: dict, args):
    """The run as a fixture: the simulation settings carry the CPU shares it measured."""
    from baton.planner.recorded import Measured, RecordedRun
    from baton.planner.simulate import SimSettings

    settings = SimSettings(profile.limits.max_num_batched_tokens, args.max_num_seqs,
                           args.transfer_overhead, 90.0,
                           prefill_cpu_share=round(shares.get("prefill", 1.0), 4),
                           decode_cpu_share=round(shares.get("decode", 1.0), 4))
    notes = (f"python -m benchmarks.planner_check on {profile.hardware.cpu}; workload "
             f"{args.workload}, rate {args.rate}, {len(records)} requests, {args.dtype}")
    return RecordedRun(name, profile, settings, v.prefill, v.decode, measured_trace(records),
                       Measured(p90(summary, "ttft_s"), p90(summary, "itl_s")), notes)


def comparison(run, planned) -> dict:
    """Per metric: the plan's own row (planned requests, pods with their cores to
    themselves), the simulation of the requests as sent on cores to themselves, the same with
    the CPU shares measured during the run, and the measured p90."""
    from dataclasses import replace

    own = replace(run, settings=replace(run.settings, prefill_cpu_share=1.0,
                                        decode_cpu_share=1.0)).predict()
    shared = run.predict()
    rows = {}
    for metric, field, measured in (("ttft_p90_s", "ttft_s", run.measured.ttft_s),
                                    ("itl_p90_s", "itl_s", run.measured.itl_s)):
        err = getattr(shared, field) / measured - 1
        rows[metric] = {"plan": getattr(planned, field), "own_cores": getattr(own, field),
                        "predicted": getattr(shared, field), "measured": measured,
                        "rel_error": err, "rel_error_own_cores": getattr(own, field) / measured - 1,
                        "within_tolerance": abs(err) <= TOLERANCE}
    return rows


def markdown(result: dict) -> str:
    lines = [f"# planner check: {result['workload']}", "",
             f"SLO: TTFT p90 <= {result['slo']['ttft_s']:g} s, ITL p90 <= "
             f"{result['slo']['itl_s']:g} s at {result['rate']:g} req/s, {result['dtype']}; "
             f"{result['cores']} cores, one per pod.", "",
             f"Plan: {result['plan']['prefill']}P:{result['plan']['decode']}D "
             f"(`baton plan` on the requests the load test sent).", "",
             "| configuration | metric | plan | sim, own cores | sim, measured CPU share | "
             "measured | error | within 15% |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for row in result["variants"].values():
        for metric in ("ttft_p90_s", "itl_p90_s"):
            c = row.get("comparison", {}).get(metric)
            if c is None:
                lines.append(f"| {row['label']} | {metric} | - | - | - | "
                             f"{_ms(row['measured'][metric])} | - | - |")
                continue
            lines.append(f"| {row['label']} | {metric} | {_ms(c['plan'])} | "
                         f"{_ms(c['own_cores'])} | {_ms(c['predicted'])} | {_ms(c['measured'])}"
                         f" | {100 * c['rel_error']:+.1f}% | "
                         f"{'yes' if c['within_tolerance'] else 'NO'} |")
    lines += ["", "Times in ms. " + result["note"], ""]
    for row in result["variants"].values():
        shares = ", ".join(f"{k} {v:.0%}" for k, v in row["cpu_share"].items())
        lines.append(f"- {row['label']}: meets the SLO measured: "
                     f"{'yes' if row['meets_slo'] else 'no'}; CPU share while runnable: "
                     f"{shares}; errors: {row['errors']}")
    return "\n".join(lines) + "\n"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1e3 * v:.1f}"


NOTE = ("'plan': `baton plan`'s row for this P:D (the planned requests, pods with their cores "
        "to themselves); 'sim, own cores': the simulation of the requests as sent; 'sim, "
        "measured CPU share': the same with each pool's steps slowed by the share of its cores "
        "its threads got while runnable (kernel run-queue accounting during the run: other "
        "work on a shared machine, the router and client beside a pod); 'error' is that "
        "prediction against the measured p90. One fewer replica: on two cores 1P:1D minus one "
        "of each is no pod, so the alternative is one colocated worker with every core; the "
        "planner does not simulate colocated pods (measured only).")


def run_all(args, planned, profile, spec, tokenizer, cores: int) -> dict:
    rows = {(r.prefill, r.decode): r for r in planned.rows}
    variants = [Variant("recommended", planned.prefill, planned.decode, 1)]
    if not args.skip_alternative:
        variants.append(Variant("one_fewer", 0, 1, cores))
    result = {"workload": spec.name, "rate": args.rate, "cores": cores, "dtype": args.dtype,
              "slo": {"ttft_s": args.ttft_slo, "itl_s": args.itl_slo},
              "plan": planned.to_json(), "note": NOTE, "variants": {}}
    for v in variants:
        summary, records, shares = run_variant(v, spec, tokenizer, args)
        ttft, itl = p90(summary, "ttft_s"), p90(summary, "itl_s")
        row = {"label": v.label, "prefill": v.prefill, "decode": v.decode,
               "measured": {"ttft_p90_s": ttft, "itl_p90_s": itl}, "cpu_share": shares,
               "meets_slo": bool(ttft is not None and itl is not None
                                 and ttft <= args.ttft_slo and itl <= args.itl_slo),
               "errors": summary["errors"]}
        if v.name == "recommended":
            run = recorded_run(f"{spec.name} {v.label}", profile, v, records, summary, shares,
                               args)
            row["comparison"] = comparison(run, rows[planned.prefill, planned.decode])
            if args.record is not None:
                run.save(args.record)
                print(f"recorded the run in {args.record}", flush=True)
        result["variants"][v.name] = row
    return result


def check(args) -> int:
    from baton.planner.plan import PlanError, format_plan
    from baton.planner.profile import Profile

    args.out.mkdir(parents=True, exist_ok=True)
    spec = WorkloadSpec.load(args.workload).with_overrides(args.num_requests, args.rate)
    cores = len(os.sched_getaffinity(0))
    profile = Profile.load(args.profile or measure_profile(args, args.out))
    tokenizer = load_tokenizer(None)
    reqs, _ = plan_requests(spec, tokenizer)
    try:
        planned = make_plan(profile, planned_trace(reqs, tokenizer, args.api), args, cores)
    except PlanError as err:
        print(f"baton plan: {err}", file=sys.stderr)
        return 1
    print(format_plan(planned, profile), flush=True)
    result = run_all(args, planned, profile, spec, tokenizer, cores)
    result["profile"] = str(args.profile or args.out / "profile.yaml")
    (args.out / "report.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (args.out / "report.md").write_text(text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.planner_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", required=True, help="a YAML file (see loadtest/workloads)")
    p.add_argument("--rate", type=float, required=True, help="open-loop req/s")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--ttft-slo", type=float, required=True, help="p90 TTFT target, s")
    p.add_argument("--itl-slo", type=float, required=True, help="p90 ITL target, s")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--profile", default=None, help="reuse a `baton profile` YAML")
    p.add_argument("--record", type=Path, default=None,
                   help="save the recommended run as a test fixture (RecordedRun JSON)")
    p.add_argument("--dtype", default="float32",
                   help="float32: where the CPU has no AVX512-BF16, bf16 prefill is ~4x slower")
    p.add_argument("--api", choices=["chat", "completions"], default="chat")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--transfer-overhead", type=float, default=0.005,
                   help="the planner's per-request KV hand-off, seconds")
    p.add_argument("--harness-cpu", type=int, default=1,
                   help="core of the router and this client in the disaggregated run")
    p.add_argument("--skip-alternative", action="store_true",
                   help="run only the recommended configuration")
    p.add_argument("--no-progress", action="store_true")
    return run_command(check, p.parse_args(argv), p.prog)


if __name__ == "__main__":
    sys.exit(main())
