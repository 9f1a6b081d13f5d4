"""What ships is what runs: the wheel built from this tree, installed into a fresh venv, holds
every C kernel source and header the engine compiles (`baton_cpu/csrc/`), and each one builds
from the installed files. (A missing header once made every installed Baton fall back to the
slower torch attention with only a warning; here that is a failure.) The load tool ships with
it; Baton's own benchmarks (`benchmarks/`) do not."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

from tests.unit.deploy.kube import ROOT

pytestmark = pytest.mark.slow

CHECK = textwrap.dedent("""
    import json, logging, sys, tempfile
    from pathlib import Path
    import baton_cpu
    from baton_cpu import build
    logging.basicConfig(level=logging.WARNING)
    package = Path(baton_cpu.__file__).parent
    cache = Path(tempfile.mkdtemp())
    sources = list(package.glob("csrc/*.[ch]"))
    built = {str(s.relative_to(package)): build.load_library(s, cache) is not None
             for s in sources if s.suffix == ".c"}
    print(json.dumps({"package": str(package), "built": built,
                      "files": sorted(str(s.relative_to(package)) for s in sources)}))
""")


def tracked_tree(dest: Path) -> Path:
    """The working tree's files, as the GPU kit copies them (scripts/gpu_kit.py)."""
    spec = importlib.util.spec_from_file_location("gpu_kit", ROOT / "scripts" / "gpu_kit.py")
    gpu_kit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_kit)
    gpu_kit.copy_tracked_files(dest)
    return dest


def test_the_installed_wheel_builds_every_native_kernel(tmp_path):
    src = tracked_tree(tmp_path / "src")
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(src)], check=True,
                   timeout=300)
    [wheel] = wheels.glob("baton-*.whl")
    shipped = zipfile.ZipFile(wheel).namelist()
    assert "baton_loadtest/cli.py" in shipped
    assert not [n for n in shipped if n.split("/")[0] == "benchmarks"], "benchmarks shipped"
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                   check=True, timeout=300)
    # The runtime's other packages (torch, ...) come from this venv, appended after the
    # fresh one's own site-packages: `baton` can only be the installed wheel.
    fresh_site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()"
                                 "[0])"], capture_output=True, text=True, check=True).stdout
    (Path(fresh_site.strip()) / "runtime.pth").write_text(sysconfig.get_paths()["purelib"])
    proc = subprocess.run([str(python), "-c", CHECK], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["package"].startswith(str(env_dir))  # the wheel, not this tree
    in_tree = sorted(str(p.relative_to(ROOT / "kernels" / "baton_cpu"))
                     for p in (ROOT / "kernels" / "baton_cpu").glob("csrc/*.[ch]"))
    assert result["files"] == in_tree  # every source and header shipped
    assert result["built"] and all(result["built"].values()), (result, proc.stderr[-3000:])
    assert "torch path is used" not in proc.stderr
