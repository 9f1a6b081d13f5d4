"""Slim a NIXL wheel (nixl-cu12 / nixl-cu13, ~59 MB) down to what its UCX backend needs.

    python scripts/slim_nixl.py WHEEL OUT_DIR     # writes OUT_DIR/<same file name>

The result is a valid wheel with the same name that moves registered memory (DRAM, and VRAM
on a GPU) between agents through UCX, on one node. It keeps:

- the Python package itself (`nixl_cu13/`: the .py files, `_bindings*.so`, `_utils*.so`, ...);
- the UCX backend plugin, `.nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so`: libnixl.so
  looks for plugins in `$NIXL_PLUGIN_DIR`, else in `plugins/` beside itself (its debug log
  says "Loading plugins from: .../.nixl_cu13.mesonpy.libs/plugins"). The second copy that
  auditwheel left in `nixl_cu13.libs/nixl/` is never loaded;
- UCX's single-node transport modules from `nixl_cu13.libs/ucx/`: cma (host memory between
  processes), cuda (cuda_copy / cuda_ipc) and ucm_cuda (CUDA memory hooks). UCX dlopens them
  as `<libucs dir>/ucx/lib<name><libucs's extension>`; it never reads the libtool .la files;
- the transitive closure of the DT_NEEDED libraries of all of the above that the wheel
  bundles (top-level files of its `*.libs` directories, where RPATH/RUNPATH point).
  libnixl.so itself links grpc and etcd-cpp-api, so those and their dependencies stay.

Everything else goes: the other plugins (POSIX, GDS, OBJ, AZURE_BLOB, ...) and their
libraries (aws, azure, libxml2, ...), UCX's InfiniBand/EFA/perftest modules (and so libibverbs,
libmlx5, libnl), the `nixl_ep_*` package (torch extensions), `*.data/` (headers, scripts,
pkgconfig) and `nixl_*.scripts/`. `*.dist-info/RECORD` is rewritten for the kept files.
Standard library only; DT_NEEDED is read by a small ELF parser, no binutils needed.
"""

from __future__ import annotations

import base64
import hashlib
import re
import struct
import sys
import zipfile
from pathlib import Path

UCX_MODULES = ("uct_cma", "uct_cuda", "ucm_cuda")


def elf_needed(data: bytes) -> list[str]:
    """The DT_NEEDED entries of an ELF file (read from its SHT_DYNAMIC section and the string
    table that section links to); [] for anything that is not ELF or has no such section."""
    if data[:4] != b"\x7fELF":
        return []
    is64, end = data[4] == 2, "<" if data[5] == 1 else ">"  # ELFCLASS64, ELFDATA2LSB
    shoff = struct.unpack_from(end + ("Q" if is64 else "I"), data, 0x28 if is64 else 0x20)[0]
    shentsize, shnum = struct.unpack_from(end + "HH", data, 0x3A if is64 else 0x2E)
    sh_fmt = end + ("IIQQQQI" if is64 else "IIIIIII")  # name, type, flags, addr, off, size, link
    dyn_fmt = end + ("qQ" if is64 else "iI")  # d_tag, d_val
    sections = []  # (type, offset, size, link)
    for i in range(shnum):
        _, sh_type, _, _, offset, size, link = struct.unpack_from(sh_fmt, data,
                                                                  shoff + i * shentsize)
        sections.append((sh_type, offset, size, link))
    names = []
    for sh_type, offset, size, link in sections:
        if sh_type != 6:  # SHT_DYNAMIC
            continue
        strtab = sections[link][1]
        for pos in range(offset, offset + size, struct.calcsize(dyn_fmt)):
            tag, value = struct.unpack_from(dyn_fmt, data, pos)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                names.append(data[strtab + value:data.index(b"\0", strtab + value)].decode())
    return names


def _is_root(name: str, package: str) -> bool:
    """A file kept for itself (its libraries follow): the package, the UCX plugin, UCX's
    single-node modules, the dist-info."""
    top = name.split("/", 1)[0]
    if top == package or top.endswith(".dist-info"):
        return not name.endswith(".dist-info/RECORD")
    if name == f".{package}.mesonpy.libs/plugins/libplugin_UCX.so":
        return True
    modules = "|".join(UCX_MODULES)
    return re.fullmatch(rf"{re.escape(package)}\.libs/ucx/lib({modules})\.so[.\d]*",
                        name) is not None


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _with_needed_libraries(src: zipfile.ZipFile, roots: list[str]) -> set[str]:
    """roots plus, transitively, the wheel's libraries that their DT_NEEDED entries name:
    the files directly inside a top-level `*.libs` dir (where the RPATHs point)."""
    libs: dict[str, list[str]] = {}  # file name -> its paths in the wheel
    for name in src.namelist():
        folder, _, base = name.rpartition("/")
        if folder.endswith(".libs") and "/" not in folder:
            libs.setdefault(base, []).append(name)
    kept, todo = set(roots), list(roots)
    while todo:
        for lib in elf_needed(src.read(todo.pop())):
            for name in libs.get(lib, ()):
                if name not in kept:
                    kept.add(name)
                    todo.append(name)
    return kept


def slim_nixl_wheel(wheel: Path, out_dir: Path) -> Path:
    """Write the slimmed copy of `wheel` into out_dir under the same name; return its path."""
    wheel, out = Path(wheel), Path(out_dir) / Path(wheel).name
    if out.resolve() == wheel.resolve():
        raise ValueError(f"{out} would overwrite the wheel it is read from")
    with zipfile.ZipFile(wheel) as src:
        infos = {i.filename: i for i in src.infolist() if not i.is_dir()}
        dist_info = next(n.split("/")[0] for n in infos if n.split("/")[0].endswith(".dist-info"))
        package = dist_info.split("-")[0]  # nixl_cu13-1.5.1.dist-info -> nixl_cu13
        kept = _with_needed_libraries(src, [n for n in infos if _is_root(n, package)])
        out.parent.mkdir(parents=True, exist_ok=True)
        record, lines = f"{dist_info}/RECORD", []
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
            for name in sorted(kept):
                data, info = src.read(name), zipfile.ZipInfo(name, infos[name].date_time)
                info.external_attr = infos[name].external_attr  # permission bits
                info.compress_type = zipfile.ZIP_DEFLATED
                dst.writestr(info, data)
                lines.append(_record_line(name, data))
            dst.writestr(record, "\n".join(lines + [f"{record},,"]) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        raise SystemExit("usage: python scripts/slim_nixl.py WHEEL OUT_DIR")
    wheel = Path(args[0])
    out = slim_nixl_wheel(wheel, Path(args[1]))
    mb = 1024 * 1024
    print(f"{wheel}: {wheel.stat().st_size / mb:.1f} MiB")
    print(f"{out}: {out.stat().st_size / mb:.1f} MiB")


if __name__ == "__main__":
    main()
