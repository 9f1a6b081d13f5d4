"""`make gpu-kit`: one folder holding exactly what a lent GPU machine lacks to run `gpu-check`.

The GPU machine (see docs: Python 3.12, torch 2.11 + CUDA 13, triton 3.6, transformers 5.17, no
network, 64 MiB carried per call) has the heavy packages but not Baton's service stack. The kit:

    gpu-kit/
      gpu-check.sh        the one command a lease runs: bash gpu-kit/gpu-check.sh
      manifest.json       what is inside: python tag, wheels, sizes, the source commit
      wheels/             manylinux x86-64 wheels of Baton's non-torch runtime and the check's
                          client (openai) for that Python, with their dependencies, and a NIXL
                          wheel cut to its UCX plugin (scripts/slim_nixl.py)
      model/SmolLM2-135M-Instruct/   the bundled model's config and tokenizer (no weights: the
                          98 MB GGUF cannot travel; the check builds random weights of its shape)
      src/                the project's files, as they are in the working tree (tracked, and
                          untracked ones git does not ignore)

    python scripts/gpu_kit.py [--out gpu-kit] [--python-version 3.12] [--no-nixl]

Runs here, with the package registry (pip download); prints the kit's path and size. The
device's own torch, triton and transformers are used as they are: our pins are for our installs.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kit_install import dist_name, normalize  # noqa: E402  (sibling scripts)
from slim_nixl import slim_nixl_wheel  # noqa: E402

MIB = 1 << 20
SIZE_LIMIT = 60 * MIB  # what a lease carries is 64 MiB, the working tree included
# glibc 2.31 at most (llguidance's wheel needs it; CUDA 13 machines have 2.31 or newer):
# gpu_kit_install.py checks the machine's glibc against each wheel's tag.
PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64")
NIXL_PIN = "nixl-cu13==1.5.1"  # torch's CUDA 13 line: the GPU machine's
MODEL_NAME = "SmolLM2-135M-Instruct"
# Runtime dependencies the kit leaves out, and why. The GPU machine has the first group; the
# second is not needed by anything the check runs (and would cost megabytes).
ON_THE_DEVICE = {"torch", "triton", "transformers", "tokenizers", "safetensors", "numpy",
                 "jinja2", "pyyaml", "aiohttp", "httpx", "uvloop", "prometheus-client", "tqdm",
                 "pytest", "pytest-timeout"}
NOT_NEEDED = {"matplotlib": "plots of load-test reports",
              "kubernetes": "the planner's Kubernetes client",
              "accelerate": "not imported by Baton",
              "gguf": "reads .gguf files; the kit carries no GGUF"}
CHECK_CLIENT = ("openai==3.51.0",)  # gpu_scenarios asks the cluster through the OpenAI client


def runtime_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """pyproject's runtime dependencies (with their pins) the device lacks, plus the client."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    keep = [d for d in deps
            if normalize(re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0])
            not in ON_THE_DEVICE | set(NOT_NEEDED)]
    return keep + list(CHECK_CLIENT)


def download_wheels(requirements: list[str], python_version: str, dest: Path) -> None:
    """Wheels for `python_version` on manylinux x86-64, dependencies resolved for it."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
           "--only-binary=:all:", "--implementation", "cp", "--python-version", python_version,
           *(arg for p in PLATFORMS for arg in ("--platform", p)), "-d", str(dest),
           *requirements]
    subprocess.run(cmd, check=True)
    for wheel in dest.glob("*.whl"):  # deps the device has: theirs are used, never shadowed
        if dist_name(wheel) in ON_THE_DEVICE:
            wheel.unlink()


def add_nixl(python_version: str, dest: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="nixl-") as tmp:
        download_wheels([NIXL_PIN], python_version, Path(tmp))
        [full] = Path(tmp).glob("nixl_cu13-*.whl")
        return slim_nixl_wheel(full, dest)


def copy_model_files(dest: Path) -> Path:
    """The bundled model's config, tokenizer and chat template, without its weights."""
    sys.path[:0] = [str(ROOT / "services")]
    from baton.engine.models.loader import resolve_model_dir

    source = resolve_model_dir(None)
    out = dest / MODEL_NAME
    out.mkdir(parents=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix not in (".safetensors", ".bin", ".gguf"):
            shutil.copy(path, out / path.name)
    return out


def copy_tracked_files(dest: Path, skip: tuple[Path, ...] = ()) -> str:
    """The working tree's tracked files, edits included, and the untracked ones git does not
    ignore (as the device tool carries them), except under `skip` (the kit being built);
    returns the commit they sit on."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        source = ROOT / name
        if any(source.resolve().is_relative_to(s.resolve()) for s in skip):
            continue
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ("+edits" if dirty else "")


def folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build(out: Path, python_version: str, nixl: bool = True) -> dict:
    """Builds the kit in a temporary folder beside `out`, then swaps it in; returns the
    manifest."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gpu-kit-", dir=out.parent))
    try:
        wheels = tmp / "wheels"
        wheels.mkdir()
        requirements = runtime_requirements()
        download_wheels(requirements, python_version, wheels)
        if nixl:
            add_nixl(python_version, wheels)
        model = copy_model_files(tmp / "model")
        commit = copy_tracked_files(tmp / "src", skip=(tmp, out))
        shutil.copy(ROOT / "scripts" / "gpu-check.sh", tmp / "gpu-check.sh")
        manifest = {
            "python_version": python_version, "platforms": list(PLATFORMS),
            "source_commit": commit, "requirements": requirements,
            "left_out": {**{n: "the GPU machine has it" for n in sorted(ON_THE_DEVICE)},
                         **NOT_NEEDED},
            "wheels": sorted(w.name for w in wheels.glob("*.whl")),
            "nixl": NIXL_PIN + " (cut to its UCX plugin)" if nixl else None,
            "model": f"model/{model.name}",
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        manifest["bytes"] = folder_size(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "gpu-kit")
    ap.add_argument("--python-version", default="3.12",
                    help="the GPU machine's Python (3.12); the CPU lease test uses ours")
    ap.add_argument("--no-nixl", action="store_true", help="leave the NIXL wheel out")
    args = ap.parse_args(argv)
    manifest = build(args.out, args.python_version, nixl=not args.no_nixl)
    size = manifest["bytes"]
    print(f"gpu kit: {args.out.resolve()} ({size / MIB:.1f} MiB, {len(manifest['wheels'])} "
          f"wheels for Python {args.python_version})")
    if size > SIZE_LIMIT:
        print(f"gpu kit: {size / MIB:.1f} MiB is over the {SIZE_LIMIT // MIB} MiB a lease can "
              "carry beside the working tree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
