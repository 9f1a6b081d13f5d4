"""A side venv with real OpenAI clients (the OpenAI Agents SDK, LangChain), built once and
cached under `.venv-clients/<key>/` (git-ignored), the key naming the requirements and the
Python that built it. The clients are not Baton's dependencies: they pin their own
`openai`, `pydantic` and `httpx`, so they run in their own interpreter and the tests drive
them as subprocesses. pip needs the package index; when it fails the tests that need the
venv are skipped with pip's reason."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / ".venv-clients"
# Floors from ../shared/ENVIRONMENT.md: without them pip may pick years-old releases.
REQUIREMENTS = ("openai-agents>=0.24", "langchain-openai>=1.7")
PIP_TIMEOUT_S = 600


def venv_python(requirements: tuple[str, ...] = REQUIREMENTS) -> Path:
    """The side venv's interpreter, built now when it is not cached. Skips the calling
    test when the venv cannot be built (pip's last lines as the reason)."""
    key = hashlib.sha256("\n".join([sys.version, *sorted(requirements)]).encode())
    home = ROOT / key.hexdigest()[:16]
    python = home / "bin" / "python"
    if (home / "complete").exists():
        return python
    building = home.with_name(home.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(building)], check=True,
                       capture_output=True, timeout=120)
        subprocess.run([str(building / "bin" / "python"), "-m", "pip", "install", "-q",
                        "--disable-pip-version-check", *requirements], check=True,
                       capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.CalledProcessError as err:
        shutil.rmtree(building, ignore_errors=True)
        tail = (err.stderr or err.stdout or "")[-600:] if isinstance(err.stderr, str) else ""
        pytest.skip(f"the real-clients venv could not be built ({' '.join(err.cmd[:4])}"
                    f" ...): {tail}")
    except subprocess.TimeoutExpired as err:
        shutil.rmtree(building, ignore_errors=True)
        pytest.skip(f"building the real-clients venv took over {err.timeout:g} s")
    (building / "complete").write_text("\n".join(requirements) + "\n")
    shutil.rmtree(home, ignore_errors=True)
    building.rename(home)  # a complete venv or none: an interrupted build is redone
    return python


def run_client(python: Path, script: str, base_url: str, timeout: float = 120.0) -> str:
    """Run `script` in the side venv with `BASE_URL` set; its stdout. A non-zero exit or a
    timeout fails the test with the script's output."""
    env = {"BASE_URL": base_url, "OPENAI_API_KEY": "unused", "PATH": "/usr/bin:/bin",
           "OPENAI_AGENTS_DISABLE_TRACING": "1"}
    try:
        done = subprocess.run([str(python), "-c", script], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the client script ran over {timeout:g} s:\n{err.stdout}\n{err.stderr}")
    if done.returncode != 0:
        pytest.fail(f"the client script failed ({done.returncode}):\n{done.stdout}\n"
                    f"{done.stderr[-4000:]}")
    return done.stdout
