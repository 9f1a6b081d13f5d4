"""`make gpu-check`: everything Baton claims on a GPU, run on this machine, in one JSON report.

    python -m baton_loadtest.gpu_check [--json gpu-check.json] [--budget-s 3000]
        [--skip-tests] [--skip-scenarios] [--skip-bench]

In order:

1. the environment: torch and its CUDA line, triton, NIXL, the devices and the driver;
2. `cuda_ran`: a real op on a CUDA tensor, read back and checked (False without CUDA);
3. the `gpu`-marked tests (tests/gpu) under pytest, counted from its JUnit XML;
4. the serving scenarios (baton_loadtest.gpu_scenarios): a prefill and a decode worker on one
   GPU with KV over nixl (and nccl where two devices exist), and `baton up --prefill 1
   --decode 1 --device cuda --gpu-memory-utilization 0.4` answering the OpenAI client exactly
   as a colocated worker does, with no KV block left held;
5. `make bench-gpu` (baton_loadtest.gpu_bench all): decode attention's KV read rate against
   the copy bandwidth, the 8B-shaped engine's decode tok/s at batch 1/32/256 and its batch-1
   step against the weight-streaming floor; the KV pull GB/s of each transport comes from 4.

`ok` is True only when tensors really ran on CUDA, every GPU test ran and passed (none
skipped), and every scenario and the benchmark ran and passed; the exit status is 1 then
when not ok. Without CUDA it says so ("no CUDA device: ..."), runs what it can (the
environment, the probe, the GPU tests, which all skip), writes the report with `ok` False
and exits 0: a CPU machine cannot fail a GPU check, nor pass one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
GPU_TESTS = "tests/gpu"


def environment() -> dict:
    """Versions and devices: what the report's numbers were measured on."""
    import importlib.util

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = [{"name": torch.cuda.get_device_name(i),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
                "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
               for i in range(count)]
    nixl = [m for m in ("nixl_cu13", "nixl_cu12", "nixl") if importlib.util.find_spec(m)]
    return {"python": sys.version.split()[0], "torch": str(torch.__version__),
            "torch_cuda": torch.version.cuda, "triton": triton_version, "nixl": nixl,
            "cuda_available": torch.cuda.is_available(), "device_count": count,
            "devices": devices, "driver": driver_version(),
            "triton_interpret": os.environ.get("TRITON_INTERPRET")}


def driver_version() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None


def cuda_probe() -> dict:
    """Runs a matmul on a CUDA tensor and checks the value read back: the proof that work
    really ran on the device (not a CPU fallback, not Triton's interpreter)."""
    if not torch.cuda.is_available():
        return {"cuda_ran": False, "reason": "no CUDA device: torch.cuda.is_available() is "
                f"False (torch {torch.__version__}, built for CUDA {torch.version.cuda})"}
    try:
        a = torch.arange(1, 1025, device="cuda", dtype=torch.float32).reshape(32, 32)
        b = torch.eye(32, device="cuda") * 2
        c = a @ b
        torch.cuda.synchronize()
        ran = c.is_cuda and c.sum().item() == 2 * sum(range(1, 1025))
        return {"cuda_ran": bool(ran), "device": str(c.device),
                "reason": None if ran else "the CUDA result read back was wrong"}
    except RuntimeError as err:
        return {"cuda_ran": False, "reason": f"a CUDA op failed: {err}"}


def run_gpu_tests(out_dir: Path, timeout_s: float) -> dict:
    """pytest on tests/gpu; counts from its JUnit XML (and the skip reasons)."""
    xml = out_dir / "gpu-tests.xml"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", GPU_TESTS,
           f"--junitxml={xml}"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"pytest {GPU_TESTS} ran past {timeout_s:.0f} s"}
    result = {"returncode": proc.returncode, "output_tail": proc.stdout[-3000:]}
    if not xml.exists():
        return {**result, "status": "error", "error": "pytest wrote no JUnit XML"}
    result.update(junit_counts(xml))
    bad = result["failed"] or result["errors"] or result["skipped"] or not result["passed"]
    result["status"] = "failed" if bad else "ok"
    return result


def junit_counts(path: Path) -> dict:
    """passed / failed / errors / skipped and the skip reasons, from a JUnit XML file."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    reasons: dict[str, int] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = next((child.tag for child in case
                        if child.tag in ("failure", "error", "skipped")), None)
        key = {"failure": "failed", "error": "errors", "skipped": "skipped"}.get(outcome,
                                                                                "passed")
        counts[key] += 1
        if outcome == "skipped":
            reason = case.find("skipped").get("message", "")
            reasons[reason] = reasons.get(reason, 0) + 1
    return {**counts, "skip_reasons": reasons}


def run_bench(out_dir: Path, timeout_s: float) -> dict:
    """`make bench-gpu` (gpu_bench all) in a subprocess; its JSON results."""
    path = out_dir / "bench-gpu.json"
    cmd = [sys.executable, "-m", "baton_loadtest.gpu_bench", "all", "--json", str(path)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"gpu_bench ran past {timeout_s:.0f} s"}
    if proc.returncode != 0 or not path.exists():
        return {"status": "error", "error": f"gpu_bench exited {proc.returncode}",
                "output_tail": (proc.stdout + proc.stderr)[-3000:]}
    return {"status": "ok", "results": json.loads(path.read_text())}


def skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


def overall_ok(report: dict) -> bool:
    """True only when tensors ran on CUDA and everything else ran and passed."""
    parts = [report["gpu_tests"], report["bench"], *report["scenarios"].values()]
    return bool(report["cuda_ran"]) and all(p.get("status") == "ok" for p in parts)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="gpu-check.json", help="where the report is written")
    ap.add_argument("--budget-s", type=float, default=3000,
                    help="the tests' time limit; scenarios get up to a third of it each")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-scenarios", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    from baton_loadtest.gpu_scenarios import run_all

    args = build_parser().parse_args(argv)
    started = time.monotonic()
    report: dict = {"environment": environment()}
    probe = cuda_probe()
    report.update(cuda_ran=probe["cuda_ran"], cuda_probe=probe)
    on_cuda = probe["cuda_ran"]
    no_cuda = probe["reason"] or "no CUDA device"
    print(f"gpu-check: torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"{report['environment']['device_count']} CUDA device(s), cuda_ran={on_cuda}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        out_dir = Path(tmp)
        report["gpu_tests"] = (skipped("--skip-tests") if args.skip_tests
                               else run_gpu_tests(out_dir, args.budget_s))
        print(f"gpu tests: {summary(report['gpu_tests'])}", flush=True)
        logs = Path(args.json).resolve().with_suffix(".logs")
        if args.skip_scenarios or not on_cuda:
            reason = "--skip-scenarios" if args.skip_scenarios else no_cuda
            report["scenarios"] = {k: skipped(reason) for k in
                                   ("colocated", "disagg_up", "kv_nixl", "kv_nccl")}
        else:
            logs.mkdir(parents=True, exist_ok=True)
            report["scenarios"] = run_all(report["environment"]["device_count"], logs,
                                          args.budget_s / 3)
        for name, result in report["scenarios"].items():
            print(f"scenario {name}: {summary(result)}", flush=True)
        report["kv_pull_gbps"] = {k: v["kv_pull"]["gbps"] for k, v in report["scenarios"].items()
                                  if "kv_pull" in v}
        report["bench"] = (skipped("--skip-bench") if args.skip_bench else
                           run_bench(out_dir, args.budget_s) if on_cuda else skipped(no_cuda))
        print(f"bench: {summary(report['bench'])}", flush=True)
    report["ok"] = overall_ok(report)
    report["seconds"] = round(time.monotonic() - started, 1)
    if not on_cuda:
        report["message"] = f"{no_cuda}; ran what runs without one, nothing is proven"
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(report.get("message") or f"gpu-check: ok={report['ok']}", flush=True)
    print(f"report: {args.json}", flush=True)
    return 0 if report["ok"] or not on_cuda else 1


def summary(result: dict) -> str:
    status = result.get("status", "?")
    if "passed" in result:
        return (f"{status}: {result['passed']} passed, {result['failed']} failed, "
                f"{result['errors']} errors, {result['skipped']} skipped")
    detail = result.get("reason") or result.get("error") or "; ".join(result.get("problems", []))
    return f"{status}: {detail}" if detail else status


if __name__ == "__main__":
    sys.exit(main())
