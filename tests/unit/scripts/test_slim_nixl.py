"""scripts/slim_nixl.py on a synthetic wheel with NIXL's layout: what stays (the package, the
UCX plugin that libnixl.so loads, UCX's single-node modules and the bundled libraries they
need), what goes, and a RECORD that matches the kept files. The ELF files are tiny shared
objects built with the C compiler (those tests skip without one); no network."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("slim_nixl", ROOT / "scripts" / "slim_nixl.py")
slim = importlib.util.module_from_spec(spec)
spec.loader.exec_module(slim)

CC = shutil.which("cc") or shutil.which("gcc")
NAME = "nixl_cu13-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl"
MESON, LIBS, INFO = ".nixl_cu13.mesonpy.libs", "nixl_cu13.libs", "nixl_cu13-1.5.1.dist-info"

# wheel path -> the DT_NEEDED names of the shared object built for it (leaves first)
ELF = {
    f"{LIBS}/libabsl-2.so": [],
    f"{LIBS}/libgrpc-1.so.48": ["libabsl-2.so"],
    f"{MESON}/libnixl.so": ["libgrpc-1.so.48"],
    "nixl_cu13/_bindings.cpython-311-x86_64-linux-gnu.so": ["libnixl.so"],
    f"{LIBS}/libucs-4.so.0": [],
    f"{LIBS}/libucp-3.so.0": ["libucs-4.so.0"],
    f"{MESON}/plugins/libplugin_UCX.so": ["libucp-3.so.0", "libnixl.so"],
    f"{LIBS}/ucx/libuct_cma.so.0.0.0": ["libucs-4.so.0"],
    f"{LIBS}/libibverbs-5.so.1": [],
    f"{LIBS}/ucx/libuct_ib.so.0.0.0": ["libibverbs-5.so.1", "libucs-4.so.0"],
    f"{LIBS}/libaws-6.so": [],
    f"{MESON}/plugins/libplugin_OBJ.so": ["libaws-6.so", "libnixl.so"],
    f"{LIBS}/nixl/libplugin_UCX.so": ["libucp-3.so.0"],  # auditwheel's unused copy
}
TEXT = {
    "nixl_cu13/__init__.py": "from ._api import nixl_agent\n",
    "nixl_cu13/_api.py": "nixl_agent = None\n",
    "nixl_cu13/py.typed": "",
    "nixl_ep_cu13/__init__.py": "import torch\n",
    "nixl_cu13-1.5.1.data/headers/asio.hpp": "#pragma once\n",
    "nixl_cu13-1.5.1.data/scripts/nixl_example": "#!/bin/sh\n",
    "nixl_cu13.scripts/nixl_example": "binary",
    f"{LIBS}/ucx/libuct_cma.la": "dlname='libuct_cma.so.0'\n",
    f"{INFO}/METADATA": "Metadata-Version: 2.1\nName: nixl-cu13\nVersion: 1.5.1\n",
    f"{INFO}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: false\n",
    f"{INFO}/licenses/LICENSE": "Apache-2.0\n",
    f"{INFO}/RECORD": "stale,,\n",
}
KEPT_WITHOUT_LIBS = {
    "nixl_cu13/__init__.py", "nixl_cu13/_api.py", "nixl_cu13/py.typed",
    "nixl_cu13/_bindings.cpython-311-x86_64-linux-gnu.so", f"{MESON}/plugins/libplugin_UCX.so",
    f"{LIBS}/ucx/libuct_cma.so.0.0.0", f"{INFO}/METADATA", f"{INFO}/WHEEL",
    f"{INFO}/licenses/LICENSE", f"{INFO}/RECORD"}
NEEDED_LIBS = {f"{MESON}/libnixl.so", f"{LIBS}/libgrpc-1.so.48", f"{LIBS}/libabsl-2.so",
               f"{LIBS}/libucp-3.so.0", f"{LIBS}/libucs-4.so.0"}


@pytest.fixture(scope="module")
def shared_objects(tmp_path_factory) -> dict[str, bytes]:
    """Each ELF entry built as a real (empty) shared object with exactly its DT_NEEDED."""
    if CC is None:
        pytest.skip("no C compiler to build the test's shared objects")
    build = tmp_path_factory.mktemp("so")
    out = {}
    for path, needed in ELF.items():
        target = build / path.replace("/", "__")
        subprocess.run([CC, "-shared", "-fPIC", "-nostdlib", "-x", "c", "/dev/null", "-o",
                        str(target), f"-L{build}", "-Wl,--no-as-needed",
                        *(f"-l:{n}" for n in needed)], check=True, capture_output=True)
        (build / Path(path).name).write_bytes(target.read_bytes())  # what -l: finds next
        out[path] = target.read_bytes()
    return out


def make_wheel(path: Path, elf: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in {**elf, **TEXT}.items():
            whl.writestr(name, data)
    return path


def read_record(whl: zipfile.ZipFile) -> dict[str, tuple[str, str]]:
    rows = [line.split(",") for line in whl.read(f"{INFO}/RECORD").decode().splitlines()]
    return {name: (digest, size) for name, digest, size in rows}


def test_elf_needed_reads_dt_needed(shared_objects):
    assert slim.elf_needed(shared_objects[f"{MESON}/plugins/libplugin_UCX.so"]) == [
        "libucp-3.so.0", "libnixl.so"]
    assert slim.elf_needed(shared_objects[f"{LIBS}/libabsl-2.so"]) == []
    assert slim.elf_needed(b"#!/bin/sh\n") == []


def test_keeps_the_ucx_path_and_the_libraries_it_links(tmp_path, shared_objects):
    wheel = make_wheel(tmp_path / NAME, shared_objects)
    out = slim.slim_nixl_wheel(wheel, tmp_path / "slim")
    assert out == tmp_path / "slim" / NAME
    with zipfile.ZipFile(out) as whl:
        assert set(whl.namelist()) == KEPT_WITHOUT_LIBS | NEEDED_LIBS
        assert whl.read(f"{MESON}/libnixl.so") == shared_objects[f"{MESON}/libnixl.so"]


def test_drops_the_rest_and_writes_a_matching_record(tmp_path):
    # no ELF at all: only the roots stay, whatever the libraries would have pulled in
    wheel = make_wheel(tmp_path / NAME, {path: b"not ELF" for path in ELF})
    out = slim.slim_nixl_wheel(wheel, tmp_path / "slim")
    with zipfile.ZipFile(out) as whl:
        names = set(whl.namelist())
        assert names == KEPT_WITHOUT_LIBS
        record = read_record(whl)
        assert set(record) == names and record[f"{INFO}/RECORD"] == ("", "")
        for name in names - {f"{INFO}/RECORD"}:
            data = whl.read(name)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            assert record[name] == (f"sha256={digest.decode()}", str(len(data)))
    with pytest.raises(ValueError):
        slim.slim_nixl_wheel(wheel, tmp_path)  # would overwrite its own input
