"""`make gpu-check` / `bash gpu-kit/gpu-check.sh`: everything Baton claims on a GPU, in pieces
under one total deadline, one JSON report rewritten after every piece.

    python -m benchmarks.gpu_check [--out DIR | --json PATH] [--deadline-s 480]
        [--only NAME,...] [--skip NAME,...] [--limit NAME=SECONDS ...] [--kit DIR] [--run-dir DIR]

The pieces, in order (`PIECES`); each runs in a subprocess of its own session with a limit of
its own, cut to what is left of the deadline, so a piece that hangs loses only itself:

- `preflight`: every module of baton, baton_kernels, baton_loadtest and benchmarks imported;
  import named with the modules that need it (before any pytest run);
- `probe`: a matmul on a CUDA tensor read back and checked: `cuda_ran` (in this process);
- `model`: the bundled model when it is installed, else a stand-in: random weights of its
  shape (seeded) beside its real config and tokenizer (the kit's), said so in the report;
- `kernel_tests`: the Triton kernels against their references on the device (tests/gpu), and
  the sm_80 / sm_90 compile check (tests/kernels/test_compile.py, runs on CPU too);
- `engine_tests`: CUDA-graph replays equal eager, greedy tokens equal transformers on the
  device (the model above and an 8B-shaped random model), a seeded sampled request;
- `bench_kernels`, `bench_engine`: decode attention's KV read rate as a share of the copy
  bandwidth; the 8B-shaped engine's decode tok/s and its batch-1 step over the weight-streaming
  floor (benchmarks.gpu_bench);
- `colocated`, `kv_tcp`, `kv_nixl` (one GPU) and `kv_nccl`, `tp2` (two GPUs): `baton up`
  clusters answering the OpenAI client, prefill + decode equal to colocated, no KV block or
  lease left held (benchmarks.gpu_scenarios);
- `engine_cpu`: the engine on CPU, greedy, token for token against this machine's
  transformers on the same model (the lease's library versions, even without a GPU).

A piece that needs more GPUs than the machine has is skipped with the reason; the report lists
the one-GPU and the multi-GPU pieces apart. `ok` is True only when tensors really ran on CUDA
and every piece this machine can run ran and passed; the exit status is 1 when a CUDA machine
is not ok. Without CUDA it says so, runs what runs on CPU (preflight, model, test collection,
the compile check) and exits 0 with `ok` False: a CPU machine can neither fail nor pass it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchmarks.gpu_pieces import (
    Deadline,
    become_subreaper,
    cuda_probe,
    descendants,
    environment,
    junit_counts,
    run_subprocess,
    sweep_orphans,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DEADLINE_S = 480.0
RESERVE_S = 5.0        # kept back for the last report
MIN_PIECE_S = 15.0     # a piece the deadline leaves less than this is skipped, not started


@dataclass(frozen=True)
class Piece:
    name: str
    gpus: int          # CUDA devices it needs to run at all (0: runs on CPU too)
    limit_s: float     # its own limit, before the deadline cuts it
    group: str         # the report's grouping: setup, one_gpu, multi_gpu
    what: str
    needs_model: bool = True  # runs on the model piece's model (or its tokenizer)


# In the order of what a lease most needs: the tests, then P/D on the device, then numbers.
# The limits of what one GPU runs add up to about the deadline; the deadline cuts the rest.
PIECES = (
    Piece("preflight", 0, 60, "setup", "every module imports; missing imports named", False),
    Piece("probe", 0, 5, "setup", "a CUDA op read back and checked (in this process)", False),
    Piece("model", 0, 60, "setup", "the bundled model, or a seeded stand-in of its shape",
          False),
    Piece("kernel_tests", 0, 120, "one_gpu", "Triton kernels vs references on the device; "
          "sm_80/90 compile", False),
    Piece("colocated", 1, 90, "one_gpu", "baton up --workers 1 on the device: the reference"),
    Piece("kv_nixl", 1, 60, "one_gpu", "prefill + decode on one GPU, KV over nixl (VRAM)"),
    Piece("kv_tcp", 1, 60, "one_gpu", "prefill + decode on one GPU, KV over tcp (staged)"),
    Piece("engine_tests", 0, 90, "one_gpu", "graph replay == eager, greedy == transformers"),
    Piece("bench_kernels", 1, 40, "one_gpu", "decode attention GB/s as a share of copy "
          "bandwidth", False),
    Piece("bench_engine", 1, 90, "one_gpu", "8B-shaped decode tok/s, batch-1 step vs weight "
          "floor"),
    Piece("kv_nccl", 2, 60, "multi_gpu", "prefill + decode on two GPUs, KV over nccl"),
    Piece("tp2", 2, 90, "multi_gpu", "one worker, tensor parallel over two GPUs"),
    # Last: on a GPU it only spends what is left; on CPU it is the versions' check.
    Piece("engine_cpu", 0, 120, "setup", "greedy == this machine's transformers, on CPU"),
)
NAMES = tuple(p.name for p in PIECES)


class Check:
    """One run: the report, the scratch folder and the deadline, and how each piece runs."""

    min_piece_s = MIN_PIECE_S

    def __init__(self, args: argparse.Namespace, report_path: Path, logs: Path, scratch: Path):
        self.args, self.report_path, self.logs, self.scratch = args, report_path, logs, scratch
        self.deadline = Deadline(args.deadline_s)
        self.env = piece_env(scratch, kept=args.run_dir is not None)
        self.report: dict = {"done": False, "ok": False, "cuda_ran": False,
                             "deadline_s": args.deadline_s, "pieces": {}}
        self.model_dir: Path | None = None
        self.probe: dict = {"cuda_ran": False, "reason": "not probed"}
        self.wanted = with_dependencies(args.only, scratch) if args.only else set(NAMES)

    # -- report ---------------------------------------------------------------------------
    def write(self) -> None:
        self.report["elapsed_s"] = round(self.deadline.elapsed(), 1)
        tmp = self.report_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report, indent=2) + "\n")
        tmp.replace(self.report_path)

    def record(self, piece: Piece, result: dict, quiet: bool = False) -> None:
        result.setdefault("needs", f"{piece.gpus} GPU{'s' if piece.gpus > 1 else ''}"
                          if piece.gpus else "runs without a GPU")
        result.setdefault("what", piece.what)
        self.report["pieces"][piece.name] = result
        self.report["numbers"] = headline_numbers(self.report["pieces"])
        if not quiet:
            print(f"{piece.name}: {summary(result)}", flush=True)
        self.write()

    # -- pieces ---------------------------------------------------------------------------
    def run(self) -> dict:
        device_count = self.report["environment"]["device_count"]
        chosen = [p for p in PIECES if self.selected(p.name)]
        for piece in chosen:  # a report cut off mid-way still names every piece
            self.record(piece, {"status": "pending"}, quiet=True)
        for piece in chosen:
            if why := self.cannot_run(piece, device_count):
                self.record(piece, {"status": "skipped", "reason": why})
                continue
            timeout = min(self.limit(piece), self.deadline.left() - RESERVE_S)
            if timeout < min(self.min_piece_s, self.limit(piece)):
                self.record(piece, {"status": "skipped", "reason": (
                    f"deadline: {self.deadline.left():.0f} s left of {self.args.deadline_s:.0f}")})
                continue
            for stale in (f"{piece.name}.json", f"{piece.name}.xml"):  # an earlier call's
                (self.scratch / stale).unlink(missing_ok=True)
            started = time.monotonic()
            before = set(descendants(os.getpid()))
            try:
                result = getattr(self, f"piece_{piece.name}", self.scenario)(piece, timeout)
            except Exception as err:  # noqa: BLE001 - one piece's bug loses only that piece
                result = {"status": "error", "error": f"{type(err).__name__}: {err}",
                          "traceback": traceback.format_exc()[-3000:]}
            finally:
                left = sweep_orphans(before)  # whatever the piece left running
            if left:
                result["stopped_leftovers"] = len(left)
            result.update(seconds=round(time.monotonic() - started, 1), limit_s=round(timeout))
            self.record(piece, result)
        return self.report

    def selected(self, name: str) -> bool:
        return name in self.wanted and name not in self.args.skip

    def limit(self, piece: Piece) -> float:
        return self.args.limits.get(piece.name, piece.limit_s)

    def cannot_run(self, piece: Piece, device_count: int) -> str | None:
        if piece.gpus and not self.report["cuda_ran"]:
            return self.report["probe_reason"]
        if piece.gpus > device_count:
            return (f"needs {piece.gpus} CUDA devices, this machine has {device_count}"
                    + (" (NCCL pairs two ranks)" if piece.name == "kv_nccl" else ""))
        if piece.needs_model and self.model_dir is None:
            return "no model: the model piece did not run or failed"
        return None

    def python(self, name: str, argv: list[str], timeout: float, env: dict | None = None
               ) -> dict:
        return run_subprocess([sys.executable, *argv], self.logs / f"{name}.log", timeout,
                              env or self.env, cwd=ROOT)

    def python_json(self, name: str, argv: list[str], timeout: float
                    ) -> tuple[dict, dict | None]:
        """`python argv --json <scratch>/<name>.json`: the run's result, and the JSON it
        wrote (None when it wrote none, or a kill cut it short)."""
        out = self.scratch / f"{name}.json"
        result = self.python(name, [*argv, "--json", str(out)], timeout)
        try:
            return result, json.loads(out.read_text())
        except (OSError, ValueError):
            return result, None

    def piece_preflight(self, piece: Piece, timeout: float) -> dict:
        result, found = self.python_json(piece.name, ["-m", "benchmarks.gpu_preflight"],
                                         timeout)
        return {**result, **(found or {})}

    def piece_probe(self, piece: Piece, timeout: float) -> dict:
        probe = self.probe  # run once, in this process, before any piece
        return {"status": "ok" if probe["cuda_ran"] else "failed", **probe}

    def piece_model(self, piece: Piece, timeout: float) -> dict:
        argv = ["-m", "benchmarks.gpu_standin", "--out", str(self.scratch / "model")]
        if self.args.kit:
            argv += ["--config-dir", str(self.args.kit / "model" / "SmolLM2-135M-Instruct")]
        result, model = self.python_json(piece.name, argv, timeout)
        if model is not None:
            result.update(model)
            self.model_dir = Path(model["path"])
            self.report["model"] = {k: model[k] for k in ("source", "path", "note")}
        return result

    def pytest(self, piece: Piece, timeout: float, paths: list[str]) -> dict:
        xml = self.scratch / f"{piece.name}.xml"
        env = dict(self.env)
        if self.model_dir is not None:
            env["BATON_TEST_MODEL_DIR"] = str(self.model_dir)
        argv = ["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml}"]
        if importlib.util.find_spec("pytest_timeout") is not None:
            # A hung test fails before our limit, so the JUnit file is still written.
            argv.append(f"--timeout={max(20, int(timeout - 15))}")
        result = self.python(piece.name, [*argv, *paths], timeout, env)
        if result["status"] == "timeout":
            return result
        if not xml.exists():
            return {**result, "status": "error", "error": "pytest wrote no JUnit XML"}
        result.update(junit_counts(xml))
        on_cuda = self.report["cuda_ran"]
        bad = result["failed"] or result["errors"] or not (result["passed"] or not on_cuda)
        if on_cuda and result["skipped"]:
            bad = True  # on a GPU nothing may skip
        result["status"] = "failed" if bad else "ok"
        return result

    def piece_kernel_tests(self, piece: Piece, timeout: float) -> dict:
        return self.pytest(piece, timeout, ["tests/gpu/test_kernels.py",
                                            "tests/kernels/test_compile.py"])

    def piece_engine_tests(self, piece: Piece, timeout: float) -> dict:
        return self.pytest(piece, timeout, ["tests/gpu/test_engine.py"])

    def piece_engine_cpu(self, piece: Piece, timeout: float) -> dict:
        result, compared = self.python_json(
            piece.name, ["-m", "benchmarks.gpu_standin", "--compare", str(self.model_dir)],
            timeout)
        return {**result, **(compared or {})}

    def bench(self, piece: Piece, timeout: float, what: str) -> dict:
        argv = ["-m", "benchmarks.gpu_bench", what]
        if what == "engine":
            argv += ["--tokenizer-dir", str(self.model_dir)]
        result, measured = self.python_json(piece.name, argv, timeout)
        if measured is not None:  # written as it goes: a timeout keeps what was measured
            result["results"] = measured
        elif result["status"] == "ok":
            result.update(status="error", error="gpu_bench wrote no JSON")
        return result

    def piece_bench_kernels(self, piece: Piece, timeout: float) -> dict:
        return self.bench(piece, timeout, "kernels")

    def piece_bench_engine(self, piece: Piece, timeout: float) -> dict:
        return self.bench(piece, timeout, "engine")

    def scenario(self, piece: Piece, timeout: float) -> dict:
        reference = self.scratch / "colocated.json"
        # Its own deadline a little inside ours, so it stops its cluster and writes its result.
        argv = ["-m", "benchmarks.gpu_scenarios", piece.name, "--model",
                str(self.model_dir), "--logs", str(self.logs),
                "--timeout-s", str(max(10.0, timeout - 15))]
        if piece.name != "colocated" and self.reference_ok(reference):
            argv += ["--reference", str(reference)]
        result, scenario = self.python_json(piece.name, argv, timeout)
        if scenario is not None:
            result.update(scenario, status=scenario["status"] if result["status"] == "ok"
                          else result["status"])
        return result

    def reference_ok(self, path: Path) -> bool:
        """The colocated answers exist and came from this model (not an earlier call's)."""
        try:
            flags = json.loads(path.read_text()).get("flags", [])
        except (OSError, ValueError):
            return False
        return str(self.model_dir) in flags

    # -- verdict --------------------------------------------------------------------------
    def finish(self) -> None:
        pieces = self.report["pieces"]
        count = self.report["environment"]["device_count"]
        for group in ("setup", "one_gpu", "multi_gpu"):
            self.report[group] = {p.name: pieces[p.name]["status"] for p in PIECES
                                  if p.group == group and p.name in pieces}
        runnable = [pieces[p.name] for p in PIECES if p.name in pieces and p.gpus <= count]
        self.report["ok"] = bool(self.report["cuda_ran"]) and bool(runnable) and all(
            r["status"] == "ok" for r in runnable) and not self.args.only
        self.report["numbers"] = headline_numbers(pieces)
        if not self.report["cuda_ran"]:
            self.report["message"] = (f"{self.report['probe_reason']}; ran what runs without "
                                      "one, nothing is proven")
        self.report["done"] = True
        self.write()


def with_dependencies(only: set[str], scratch: Path) -> set[str]:
    """`--only` plus what those pieces need: the model (reused when built before), and the
    colocated reference for the P/D pieces unless an earlier call left one."""
    wanted = set(only) | {"probe"}
    by_name = {p.name: p for p in PIECES}
    if any(by_name[n].needs_model for n in only):
        wanted.add("model")
    if only & {"kv_tcp", "kv_nixl", "kv_nccl"} and not (scratch / "colocated.json").exists():
        wanted.add("colocated")
    return wanted


def headline_numbers(pieces: dict) -> dict:
    """The few numbers a closing note quotes, pulled out of the pieces."""
    numbers: dict = {}
    kernels = pieces.get("bench_kernels", {}).get("results", {})
    if best := kernels.get("kernels", {}).get("best_large"):
        numbers["decode_attention_share_of_copy"] = round(best["fraction_of_copy"], 3)
    if copy := kernels.get("copy"):
        numbers["copy_gbps"] = round(copy["gbps"], 1)
    engine = pieces.get("bench_engine", {}).get("results", {}).get("engine", {})
    if floor := engine.get("weight_floor"):
        numbers["batch1_step_over_weight_floor"] = round(floor["step_over_floor"], 2)
        numbers["batch1_step_ms"] = round(floor["step_ms"], 3)
    for row in engine.get("batches", []):
        numbers[f"decode_tok_s_batch{row['batch']}"] = round(row["output_tok_s"], 1)
    for name in ("kernel_tests", "engine_tests"):
        if "passed" in pieces.get(name, {}):
            numbers[name] = {k: pieces[name][k] for k in ("passed", "failed", "errors",
                                                          "skipped")}
    for name in ("kv_tcp", "kv_nixl", "kv_nccl"):
        if gbps := pieces.get(name, {}).get("kv_pull", {}).get("gbps"):
            numbers[f"{name}_pull_gbps"] = gbps
    return numbers


def piece_env(scratch: Path, kept: bool) -> dict:
    """The pieces' environment: kernels on the device (never the interpreter). With a run
    folder, the caches (Triton's compiled kernels, the engine's) live there, kept for a
    second call on the same machine."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if kept:
        env.setdefault("TRITON_CACHE_DIR", str(scratch / "triton-cache"))
        env.setdefault("XDG_CACHE_HOME", str(scratch / "cache"))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def summary(result: dict) -> str:
    status = result.get("status", "?")
    seconds = f" in {result['seconds']} s" if "seconds" in result else ""
    if "passed" in result:
        return (f"{status}{seconds}: {result['passed']} passed, {result['failed']} failed, "
                f"{result['errors']} errors, {result['skipped']} skipped")
    detail = (result.get("reason") or result.get("error")
              or "; ".join(result.get("problems", [])[:3]))
    return f"{status}{seconds}: {detail}" if detail else f"{status}{seconds}"


def parse_limits(items: list[str]) -> dict[str, float]:
    limits = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in NAMES or not value:
            raise argparse.ArgumentTypeError(f"--limit {item!r}: NAME=SECONDS, NAME one of "
                                             f"{', '.join(NAMES)}")
        limits[name] = float(value)
    return limits


def name_list(text: str) -> set[str]:
    names = {n for n in text.split(",") if n}
    if unknown := names - set(NAMES):
        raise argparse.ArgumentTypeError(f"unknown pieces {sorted(unknown)}; the pieces: "
                                         f"{', '.join(NAMES)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for gpu-check.json and logs/ (default: $OUT, else beside "
                         "--json)")
    ap.add_argument("--json", type=Path, default=None, help="the report's path")
    ap.add_argument("--kit", type=Path, default=None,
                    help="the gpu kit this runs from (its model config and tokenizer)")
    ap.add_argument("--run-dir", type=Path, default=None,
                    help="a folder kept between calls (the stand-in model, compiled kernels); "
                         "default: a temporary one")
    ap.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S,
                    help="one limit for the whole check (default %(default)s)")
    ap.add_argument("--only", type=name_list, default=set(), help="run only these pieces")
    ap.add_argument("--skip", type=name_list, default=set(), help="leave these pieces out")
    ap.add_argument("--limit", dest="limits", action="append", default=[],
                    help="NAME=SECONDS: one piece's own limit")
    return ap


@contextmanager
def scratch_folder(run_dir: Path | None):
    """The run folder kept between calls (a second call reuses its stand-in model and
    compiled kernels), else a temporary one."""
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        yield run_dir.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        yield Path(tmp)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.limits = parse_limits(args.limits)
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    report_path = args.json or ((out or Path.cwd()) / "gpu-check.json")
    logs = (out / "logs") if out else report_path.with_suffix(".logs")
    logs.mkdir(parents=True, exist_ok=True)
    report_path.parent.mkdir(parents=True, exist_ok=True)
    become_subreaper()  # a piece's orphans come back to us, to be stopped
    with scratch_folder(args.run_dir) as scratch:
        check = Check(args, report_path, logs, scratch)
        check.report["environment"] = environment()
        if args.kit and (args.kit / "manifest.json").exists():
            check.report["kit"] = json.loads((args.kit / "manifest.json").read_text())
        check.probe = probe = cuda_probe()
        check.report.update(cuda_ran=probe["cuda_ran"], probe_reason=probe["reason"])
        env = check.report["environment"]
        print(f"gpu-check: torch {env['torch']} (CUDA {env['torch_cuda']}), "
              f"{env['device_count']} CUDA device(s), cuda_ran={probe['cuda_ran']}, deadline "
              f"{args.deadline_s:.0f} s; report {report_path}", flush=True)
        check.write()
        check.run()
        check.finish()
    report = check.report
    print(report.get("message") or f"gpu-check: ok={report['ok']}", flush=True)
    print(f"report: {report_path}", flush=True)
    return 0 if report["ok"] or not report["cuda_ran"] else 1


if __name__ == "__main__":
    sys.exit(main())
