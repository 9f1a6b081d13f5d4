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
- `bench_quant`: an 8B-shaped decode step's linears in bf16, W4A16 and FP8, each as a ratio
  of bf16's (benchmarks.gpu_quant_bench);
- `bench_kv_tier`: the host KV offload tier's copies between the device cache and pinned
  host blocks, GB/s each way, and what one step's offloads add to a step
  (benchmarks.gpu_tier_bench);
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
import json
import os
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

from benchmarks.gpu_check_pieces import NAMES, PIECES, Piece, PieceRunner, with_dependencies
from benchmarks.gpu_pieces import (
    Deadline,
    become_subreaper,
    cuda_probe,
    descendants,
    environment,
    sweep_orphans,
)

DEFAULT_DEADLINE_S = 480.0
RESERVE_S = 5.0        # kept back for the last report
MIN_PIECE_S = 15.0     # a piece the deadline leaves less than this is skipped, not started


class Check:
    """One run: the report, the deadline, and the pieces in turn (run by `runner`)."""

    min_piece_s = MIN_PIECE_S

    def __init__(self, args: argparse.Namespace, report_path: Path, logs: Path, scratch: Path,
                 runner: PieceRunner | None = None) -> None:
        self.args, self.report_path, self.logs, self.scratch = args, report_path, logs, scratch
        self.deadline = Deadline(args.deadline_s)
        self.runner = runner or PieceRunner(args, logs, scratch)
        self.report: dict = {"done": False, "ok": False, "cuda_ran": False,
                             "deadline_s": args.deadline_s, "pieces": {}}
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
                result = self.runner.run(piece, timeout)
            except Exception as err:  # noqa: BLE001 - one piece's bug loses only that piece
                result = {"status": "error", "error": f"{type(err).__name__}: {err}",
                          "traceback": traceback.format_exc()[-3000:]}
            finally:
                left = sweep_orphans(before)  # whatever the piece left running
            if left:
                result["stopped_leftovers"] = len(left)
            result.update(seconds=round(time.monotonic() - started, 1), limit_s=round(timeout))
            self.record(piece, result)
            if piece.name == "model" and self.runner.model is not None:
                self.report["model"] = self.runner.model
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
        if piece.needs_model and self.runner.model_dir is None:
            return "no model: the model piece did not run or failed"
        return None

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
        if "error" in row:
            mode = "ahead" if row.get("async_scheduling") == "on" else "sync"
            numbers[f"decode_batch{row['batch']}_{mode}_error"] = row["error"][:200]
            continue
        ahead = "_ahead" if row.get("async_scheduling") == "on" else ""
        numbers[f"decode_tok_s_batch{row['batch']}{ahead}"] = round(row["output_tok_s"], 1)
        if ahead:
            numbers[f"device_busy_batch{row['batch']}_ahead"] = round(row["device_busy"], 3)
    if fitted := engine.get("sim", {}).get("fit"):
        numbers["sim_profile_fit"] = fitted
    quant = pieces.get("bench_quant", {}).get("results", {}).get("formats", {})
    for fmt in ("w4a16_g128", "fp8_channel", "fp8_block"):
        if ratio := quant.get(fmt, {}).get("1", {}).get("vs_bf16"):
            numbers[f"{fmt}_batch1_step_vs_bf16"] = ratio
    tier = pieces.get("bench_kv_tier", {}).get("results", {})
    for key in ("offload_gbps", "load_gbps"):
        if (gbps := tier.get("copies", {}).get(key)) is not None:
            numbers[f"kv_tier_{key}"] = round(gbps, 1)
    if (overlap := tier.get("step", {}).get("overlap")) is not None:
        numbers["kv_tier_offload_overlap"] = round(overlap, 2)
    for name in ("kernel_tests", "engine_tests"):
        if "passed" in pieces.get(name, {}):
            numbers[name] = {k: pieces[name][k] for k in ("passed", "failed", "errors",
                                                          "skipped")}
    for name in ("kv_tcp", "kv_nixl", "kv_nccl"):
        if gbps := pieces.get(name, {}).get("kv_pull", {}).get("gbps"):
            numbers[f"{name}_pull_gbps"] = gbps
    return numbers


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
        check.runner.probe = probe = cuda_probe()
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
