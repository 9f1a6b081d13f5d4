"""A GPU lease, simulated on CPU: the kit (scripts/gpu_kit.py, built for this Python) and a
fresh venv holding only what the GPU machine has (torch, triton 3.6, transformers 5.17, ...:
at its versions where they exist for our Python; torch 2.13 CPU stands in for 2.11), then
`bash kit/gpu-check.sh` as a lease runs it: the kit's wheels installed --no-index, every
import found, the stand-in model built, every piece accounted for inside the deadline. A
second run on the same machine reuses the stand-in, and a piece past its limit loses only
itself. (The deadline's arithmetic: tests/unit/benchmarks/test_gpu_check.py.)

Needs the package registry once, for `pip download` and the venv (as `make gpu-kit` does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest

from benchmarks.gpu_check_pieces import PIECES
from tests.unit.deploy.kube import ROOT

pytestmark = pytest.mark.slow

# The GPU machine's packages that matter to Baton (ENVIRONMENT.md), torch as our CPU build.
LEASE_PACKAGES = ["torch==2.13.0", "triton==3.6.0", "transformers==5.17.0", "tokenizers",
                  "safetensors", "numpy", "aiohttp", "httpx", "uvloop", "prometheus-client",
                  "pyyaml", "jinja2", "pytest", "pytest-timeout"]
MIB = 1 << 20


def clean_env(**extra: str) -> dict:
    """This machine's environment without the project venv (as on the GPU machine)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET", "XDG_CACHE_HOME")}
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p != venv_bin)
    return {**env, **extra}


@pytest.fixture(scope="module")
def lease_python(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lease-venv")
    venv.create(root, with_pip=True)
    python = root / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    *LEASE_PACKAGES], check=True, timeout=900, env=clean_env())
    return python


def build_kit(out: Path, version: str) -> Path:
    proc = subprocess.run([sys.executable, "scripts/gpu_kit.py", "--out", str(out),
                           "--python-version", version], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"gpu kit: {out}" in proc.stdout
    return out


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Path:
    """The kit for this machine's Python (the simulated lease runs it)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return build_kit(tmp_path_factory.mktemp("kit") / "gpu-kit", version)


@pytest.fixture(scope="module")
def kit312(tmp_path_factory) -> Path:
    """The kit a lease carries: `make gpu-kit`'s (CI builds it first), else one built here."""
    made = ROOT / "gpu-kit"
    if (made / "manifest.json").exists() and json.loads(
            (made / "manifest.json").read_text())["python_version"] == "3.12":
        return made
    return build_kit(tmp_path_factory.mktemp("kit312") / "gpu-kit", "3.12")


def lease_env(kit: Path, python: Path) -> dict:
    """What gpu-check.sh gives its pieces: the kit's site first, then the kit's tree."""
    paths = [kit.parent / ".gpu-run" / "site",
             *(kit / "src" / p for p in ("services", "kernels", "loadtest", "."))]
    return clean_env(PYTHONPATH=os.pathsep.join(map(str, paths)))


def gpu_check(kit: Path, python: Path, out: Path, *args: str, timeout: float = 600):
    started = time.monotonic()
    proc = subprocess.run(["bash", str(kit / "gpu-check.sh"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=out.parent,
                          env=clean_env(PYTHON=str(python), OUT=str(out)))
    seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu-check.json").read_text()), proc.stdout, seconds


def test_the_carried_kit_is_the_simulated_one_built_for_python_312(kit, kit312):
    ours = json.loads((kit / "manifest.json").read_text())
    carried = json.loads((kit312 / "manifest.json").read_text())
    assert carried["python_version"] == "3.12"
    names = {w.split("-")[0].lower() for w in carried["wheels"]}
    assert names == {w.split("-")[0].lower() for w in ours["wheels"]}  # the same packages
    for wheel in carried["wheels"]:  # each one importable by CPython 3.12
        python_tag, abi = wheel.split("-")[-3:-1]
        assert python_tag.startswith("py3") or python_tag == "cp312" or abi == "abi3", wheel
    size = sum(p.stat().st_size for p in kit312.rglob("*") if p.is_file())
    assert size < 60 * MIB


def test_the_kit_holds_what_the_lease_lacks_and_fits(kit):
    manifest = json.loads((kit / "manifest.json").read_text())
    wheels = {w.split("-")[0].lower() for w in manifest["wheels"]}
    assert {"pydantic", "fastapi", "uvicorn", "jsonschema", "llguidance", "openai",
            "nixl_cu13"} <= wheels
    assert not {"torch", "triton", "transformers", "numpy"} & wheels  # the machine's own
    assert (kit / "model" / "SmolLM2-135M-Instruct" / "tokenizer.json").exists()
    assert not list((kit / "model").rglob("*.safetensors"))
    assert (kit / "src" / "benchmarks" / "gpu_check.py").exists()
    source = sum(p.stat().st_size for p in (kit / "src").rglob("*") if p.is_file())
    assert source < 10 * MIB  # the tree, not the kit being built inside it
    size = sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())
    assert size < 60 * MIB


def test_gpu_check_runs_whole_from_the_kit_in_the_lease_environment(kit, lease_python,
                                                                    tmp_path):
    report, stdout, seconds = gpu_check(kit, lease_python, tmp_path / "out")
    install = json.loads((tmp_path / "out" / "kit-install.json").read_text())
    assert not install["errors"] and "fastapi" in install["installed"]
    assert "torch" not in install["installed"]
    assert report["done"] and report["cuda_ran"] is False and report["ok"] is False
    assert report["elapsed_s"] < report["deadline_s"] == 480 and seconds < 480
    pieces = report["pieces"]
    assert set(pieces) == {p.name for p in PIECES}  # every piece accounted for
    preflight = pieces["preflight"]
    assert preflight["status"] == "ok", preflight  # every import the check needs is there
    assert preflight["missing"] == {} and preflight["nixl"] == "nixl_cu13"
    assert report["model"]["source"] == "stand-in"
    assert Path(report["model"]["path"]).name == "SmolLM2-135M-Instruct"
    kernels = pieces["kernel_tests"]  # the sm_80 / sm_90 compile check ran on triton 3.6
    assert kernels["status"] == "ok" and kernels["tests"][
        "test_kernels_compile_for_sm90_and_sm80"] == "passed"
    assert pieces["engine_tests"]["status"] == "ok" and pieces["engine_tests"]["skipped"] >= 4
    # The engine on CPU equals transformers 5.17 (the lease's) token for token.
    assert pieces["engine_cpu"]["status"] == "ok" and pieces["engine_cpu"]["equal"]
    for piece in PIECES:
        if piece.gpus:
            assert pieces[piece.name]["status"] == "skipped"
            assert pieces[piece.name]["reason"].startswith("no CUDA device")
    assert "no CUDA device" in stdout and (tmp_path / "out" / "logs" / "model.log").exists()

    # The same machine again: the stand-in is reused, and a piece past its limit (2 s is
    # less than pytest takes to start) loses only itself; the report still ends whole.
    report, _, seconds = gpu_check(kit, lease_python, tmp_path / "again", "--limit",
                                   "kernel_tests=2")
    pieces = report["pieces"]
    assert report["done"] and set(pieces) == {p.name for p in PIECES}
    assert pieces["model"]["status"] == "ok" and pieces["model"]["seconds"] < 15  # reused
    assert pieces["kernel_tests"]["status"] == "timeout"
    assert pieces["engine_tests"]["status"] == "ok"
    assert not (kit / "site").exists() and not (kit / "run").exists()  # the kit stays small


def test_the_lease_environment_runs_the_kernels_and_nixl(kit, lease_python, tmp_path):
    """In the lease's packages, from the kit: a Triton kernel test in triton 3.6's
    interpreter, and the transport conformance suite over the slimmed NIXL (its UCX plugin
    moving host memory between two agents)."""
    if not (kit.parent / ".gpu-run" / "site").exists():
        gpu_check(kit, lease_python, tmp_path / "out", "--only", "preflight")
    env = lease_env(kit, lease_python)
    for args in (["tests/kernels/test_paged_attention.py", "-k", "decode"],
                 ["tests/unit/kv_transfer/test_conformance.py", "-k", "nixl"]):
        proc = subprocess.run([str(lease_python), "-m", "pytest", "-q", "-p",
                               "no:cacheprovider", *args], cwd=kit / "src", env=env,
                              capture_output=True, text=True, timeout=600)
        summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        assert "passed" in summary and "skipped" not in summary, summary
