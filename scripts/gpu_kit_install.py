"""Install the GPU kit's wheels this machine lacks, or has at an older version, into a site
folder that goes first on PYTHONPATH (gpu-check.sh's first step).

    python3 scripts/gpu_kit_install.py KIT --site DIR [--report kit-install.json]

Standard library only: it runs before anything of Baton's is importable. The kit holds no
torch, triton or transformers: the machine's own are used as they are. A dependency the
machine has at an older version than the kit's (typing-extensions, anyio, ...) is installed
too, and shadows it: the kit's packages were resolved against the newer one. pip installs
with --no-index --no-deps --target; where pip is missing or fails, the wheels are unpacked by
hand (a wheel is a zip of its import tree). Never fails the lease: what went wrong is in the
report, and gpu_check's preflight names every import that is still missing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path


def normalize(name: str) -> str:
    """A distribution's name as the registry compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def dist_name(wheel: Path) -> str:
    return normalize(wheel.name.split("-")[0])


def wheel_version(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def version_key(version: str) -> tuple:
    """A comparable form of a version: packaging's where this Python has it, else its
    leading numbers (enough for the releases a kit holds)."""
    try:
        from packaging.version import Version
    except ImportError:
        try:
            from pip._vendor.packaging.version import Version
        except ImportError:
            return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0])[:4])
    try:
        return (Version(version),)
    except Exception:  # noqa: BLE001 - an odd version string: compare its numbers
        return tuple(int(n) for n in re.findall(r"\d+", version)[:4])


def needs_install(wheel: Path, have: str | None) -> bool:
    return have is None or version_key(have) < version_key(wheel_version(wheel))


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def python_mismatch(wheels: list[Path]) -> list[str]:
    """Binary wheels built for another CPython than this one (they would not import)."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return [w.name for w in wheels
            if re.search(r"-cp3\d+-", w.name) and f"-{tag}-" not in w.name
            and "-abi3-" not in w.name]


def glibc_too_old(wheels: list[Path]) -> list[str]:
    """Wheels whose lowest manylinux_X_Y tag needs a newer glibc than this machine's."""
    try:
        found = re.search(r"(\d+)\.(\d+)", os.confstr("CS_GNU_LIBC_VERSION") or "")
    except (ValueError, OSError):
        return []
    if not found:
        return []
    have = (int(found[1]), int(found[2]))
    too_old = []
    for wheel in wheels:
        tags = [(int(a), int(b)) for a, b in re.findall(r"manylinux_(\d+)_(\d+)_", wheel.name)]
        if tags and min(tags) > have:
            too_old.append(wheel.name)
    return too_old


def unpack(wheel: Path, site: Path) -> None:
    """What pip --target does for a wheel, minus scripts: its tree, and *.data/{pure,plat}lib
    merged into it."""
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            target = site.joinpath(*parts)
            if info.is_dir():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = info.external_attr >> 16
            if mode:
                target.chmod(mode & 0o777 or 0o644)


def install(wheels: list[Path], site: Path) -> str:
    if importlib.util.find_spec("pip") is not None:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
               "--no-index", "--no-deps", "--no-compile", "--target", str(site),
               *map(str, wheels)]
        try:
            if subprocess.run(cmd, timeout=300).returncode == 0:
                return "pip"
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(site, ignore_errors=True)  # whatever pip left half done
        site.mkdir(parents=True)
    for wheel in wheels:
        unpack(wheel, site)
    return "unpacked"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kit", type=Path)
    ap.add_argument("--site", type=Path, required=True, help="where the wheels go")
    ap.add_argument("--report", type=Path, default=None)
    args = ap.parse_args(argv)
    started = time.monotonic()
    site = args.site
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    wheels = sorted((args.kit / "wheels").glob("*.whl"))
    have = {dist_name(w): installed_version(dist_name(w)) for w in wheels}
    missing = [w for w in wheels if needs_install(w, have[dist_name(w)])]
    report: dict = {"python": sys.version.split()[0], "site": str(site),
                    "device_has": {n: v for n, v in sorted(have.items()) if v},
                    "installed": {dist_name(w): wheel_version(w) for w in missing},
                    "errors": []}
    if bad := python_mismatch(missing):
        report["errors"].append(f"built for another Python than {report['python']}: {bad}")
    if old := glibc_too_old(missing):
        report["errors"].append(f"need a newer glibc than this machine's: {old}")
    try:
        report["method"] = install(missing, site) if missing else "nothing to install"
    except Exception as err:  # noqa: BLE001 - reported; the check's preflight goes on
        report["errors"].append(f"{type(err).__name__}: {err}")
    report["seconds"] = round(time.monotonic() - started, 1)
    text = json.dumps(report, indent=1)
    if args.report:
        args.report.write_text(text + "\n")
    print(f"kit: {len(missing)} wheels installed into {site} ({report.get('method')}), "
          f"{len(report['device_has'])} already here; errors: {report['errors'] or 'none'}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
