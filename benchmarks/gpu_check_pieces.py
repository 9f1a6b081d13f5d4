"""The pieces of `benchmarks.gpu_check` and how each runs (`PieceRunner`): the table of pieces
in the order a lease most needs them, and one subprocess per piece — a pytest run, a
benchmark, a `baton up` scenario — whose JSON result is read back."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.gpu_pieces import junit_counts, run_subprocess, unexpected_skips

ROOT = Path(__file__).resolve().parents[1]


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
    Piece("kernel_tests", 0, 160, "one_gpu", "Triton kernels vs references on the device; "
          "sm_80/90 compile", False),
    Piece("colocated", 1, 90, "one_gpu", "baton up --workers 1 on the device: the reference"),
    Piece("kv_nixl", 1, 60, "one_gpu", "prefill + decode on one GPU, KV over nixl (VRAM)"),
    Piece("kv_tcp", 1, 60, "one_gpu", "prefill + decode on one GPU, KV over tcp (staged)"),
    Piece("engine_tests", 0, 120, "one_gpu", "graph replay == eager, greedy == transformers, "
          "mixed LoRA adapters on the Triton kernels"),
    Piece("bench_kernels", 1, 40, "one_gpu", "decode attention GB/s as a share of copy "
          "bandwidth", False),
    Piece("bench_quant", 1, 90, "one_gpu", "8B-shaped decode step's linears: bf16 vs W4A16 "
          "vs FP8 (issue 39)", False),
    Piece("bench_engine", 1, 90, "one_gpu", "8B-shaped decode tok/s, batch-1 step vs weight "
          "floor"),
    Piece("bench_kv_tier", 1, 30, "one_gpu", "the host KV tier's copies: GB/s each way, "
          "and their cost to a step (issue 36)", False),
    Piece("kv_nccl", 2, 60, "multi_gpu", "prefill + decode on two GPUs, KV over nccl"),
    Piece("tp2", 2, 90, "multi_gpu", "one worker, tensor parallel over two GPUs"),
    # Last: on a GPU it only spends what is left; on CPU it is the versions' check.
    Piece("engine_cpu", 0, 120, "setup", "greedy == this machine's transformers, on CPU"),
)
NAMES = tuple(p.name for p in PIECES)


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


class PieceRunner:
    """How each piece runs: a subprocess of its own (its log under `logs`, the JSON it
    writes under `scratch`), and what one piece leaves the next: the model's folder."""

    def __init__(self, args: argparse.Namespace, logs: Path, scratch: Path) -> None:
        self.args, self.logs, self.scratch = args, logs, scratch
        self.env = piece_env(scratch, kept=args.run_dir is not None)
        self.probe: dict = {"cuda_ran": False, "reason": "not probed"}
        self.model_dir: Path | None = None  # the model piece's
        self.model: dict | None = None  # where it came from, for the report
        self.runs: dict[str, Callable[[Piece, float], dict]] = {
            "preflight": self.preflight, "probe": self.probe_result, "model": self.build_model,
            "kernel_tests": self.kernel_tests, "engine_tests": self.engine_tests,
            "bench_kernels": self.bench_kernels, "bench_engine": self.bench_engine,
            "bench_quant": self.bench_quant, "bench_kv_tier": self.bench_kv_tier,
            "engine_cpu": self.engine_cpu}  # the rest: baton up scenarios

    def run(self, piece: Piece, timeout: float) -> dict:
        """Run `piece` within `timeout` seconds; its result (`status` and what it found)."""
        return self.runs.get(piece.name, self.scenario)(piece, timeout)

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

    def preflight(self, piece: Piece, timeout: float) -> dict:
        result, found = self.python_json(piece.name, ["-m", "benchmarks.gpu_preflight"],
                                         timeout)
        return {**result, **(found or {})}

    def probe_result(self, piece: Piece, timeout: float) -> dict:
        probe = self.probe  # run once, in the check's process, before any piece
        return {"status": "ok" if probe["cuda_ran"] else "failed", **probe}

    def build_model(self, piece: Piece, timeout: float) -> dict:
        argv = ["-m", "benchmarks.gpu_standin", "--out", str(self.scratch / "model")]
        if self.args.kit:
            argv += ["--config-dir", str(self.args.kit / "model" / "SmolLM2-135M-Instruct")]
        result, model = self.python_json(piece.name, argv, timeout)
        if model is not None:
            result.update(model)
            self.model_dir = Path(model["path"])
            self.model = {k: model[k] for k in ("source", "path", "note")}
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
        on_cuda = self.probe["cuda_ran"]
        bad = result["failed"] or result["errors"] or not (result["passed"] or not on_cuda)
        gpus = self.probe.get("device_count", 1)
        if on_cuda and unexpected_skips(result["skip_reasons"], gpus):
            bad = True  # on a GPU nothing may skip but a test for more GPUs than it has
        result["status"] = "failed" if bad else "ok"
        return result

    def kernel_tests(self, piece: Piece, timeout: float) -> dict:
        return self.pytest(piece, timeout, ["tests/gpu/test_kernels.py",
                                            "tests/kernels/test_fp8_cache.py",
                                            "tests/gpu/test_quant_kernels.py",
                                            "tests/kernels/test_quant_gemm.py",
                                            "tests/kernels/test_fp8_gemm.py",
                                            "tests/kernels/test_lora.py",
                                            "tests/kernels/test_compile.py"])

    def engine_tests(self, piece: Piece, timeout: float) -> dict:
        return self.pytest(piece, timeout, ["tests/gpu/test_engine.py", "tests/gpu/test_lora.py"])

    def engine_cpu(self, piece: Piece, timeout: float) -> dict:
        result, compared = self.python_json(
            piece.name, ["-m", "benchmarks.gpu_standin", "--compare", str(self.model_dir)],
            timeout)
        return {**result, **(compared or {})}

    def bench(self, piece: Piece, timeout: float, what: str,
              module: str = "benchmarks.gpu_bench") -> dict:
        argv = ["-m", module, *([what] if what else [])]
        if what == "engine":
            argv += ["--tokenizer-dir", str(self.model_dir)]
        result, measured = self.python_json(piece.name, argv, timeout)
        if measured is not None:  # written as it goes: a timeout keeps what was measured
            result["results"] = measured
        elif result["status"] == "ok":
            result.update(status="error", error=f"{module} wrote no JSON")
        return result

    def bench_kernels(self, piece: Piece, timeout: float) -> dict:
        return self.bench(piece, timeout, "kernels")

    def bench_engine(self, piece: Piece, timeout: float) -> dict:
        return self.bench(piece, timeout, "engine")

    def bench_quant(self, piece: Piece, timeout: float) -> dict:
        return self.bench(piece, timeout, "", "benchmarks.gpu_quant_bench")

    def bench_kv_tier(self, piece: Piece, timeout: float) -> dict:
        return self.bench(piece, timeout, "", "benchmarks.gpu_tier_bench")

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
