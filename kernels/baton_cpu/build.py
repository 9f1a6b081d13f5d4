"""The C kernels of `csrc/`, built with the system C compiler on first use and loaded with
ctypes.

A library is built once per source version into `<cache_dir>/kernels/` (an atomic rename, so
concurrent builders agree). It links the libgomp that torch has loaded (by soname), so both
share one OpenMP thread pool and its thread count. Without a compiler, or when the build
fails, `load_library` returns None and callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11",
         "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
_lock = threading.Lock()
_cached: dict[tuple[str, str, tuple[str, ...]], ctypes.CDLL | None] = {}
CSRC = Path(__file__).parent / "csrc"


def load_library(source: str | Path, cache_dir: Path,
                 extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled `source` (a file name in `csrc/`, or a path), or None (logged once) when
    it cannot be built here. `extra_flags` follow `FLAGS` (so they override them)."""
    source = CSRC / source
    with _lock:
        key = (str(source), str(cache_dir), extra_flags)
        if key not in _cached:
            _cached[key] = _build_and_load(source, Path(cache_dir), [*FLAGS, *extra_flags])
        return _cached[key]


def _build_and_load(source: Path, cache_dir: Path,
                    flags: list[str] | None = None) -> ctypes.CDLL | None:
    flags = FLAGS if flags is None else flags
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler found: %s is not built, the torch path is used",
                    source.name)
        return None
    try:
        text = _source_with_headers(source)
    except OSError as err:
        log.warning("cannot read %s (%s): the torch path is used", source.name, err)
        return None
    digest = hashlib.sha1(text + " ".join(flags).encode()).hexdigest()[:12]
    lib_path = cache_dir / "kernels" / f"{source.stem}-{digest}.so"
    try:
        if not lib_path.exists():
            lib_path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
                tmp_lib = Path(tmp) / lib_path.name
                subprocess.run([cc, *flags, str(source), "-o", str(tmp_lib), "-lm"],
                               check=True, capture_output=True, timeout=120)
                tmp_lib.replace(lib_path)
        return ctypes.CDLL(str(lib_path))
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("could not build %s (%s): the torch path is used", source.name, err)
        return None


def _source_with_headers(source: Path) -> bytes:
    """The source and the local files it includes (`#include "..."`, and what those include):
    a change to any makes a new build."""
    text = source.read_bytes()
    headers = re.findall(rb'^#include "([^"]+)"', text, flags=re.MULTILINE)
    return text + b"".join(_source_with_headers(source.parent / h.decode()) for h in headers)
