"""Model weights in a Hugging Face hub cache: `hf://ORG/NAME[@REVISION]` resolved offline, and
the download the Helm chart's init container runs before a worker starts.

The cache layout is the one `huggingface_hub` writes (`snapshot_download(cache_dir=...)`):

    <cache>/models--ORG--NAME/refs/REVISION            the commit a branch or tag points at
    <cache>/models--ORG--NAME/snapshots/COMMIT/...      the files (links into blobs/)

`resolve_hub_model(model, revision=...)` turns `hf://ORG/NAME[@REVISION]`, a bare repo id
`ORG/NAME` that is not a local path (as `vllm serve Qwen/Qwen3-0.6B`), both looked up in the
hub cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`), or the path
of a `models--ORG--NAME` directory into the snapshot directory the loader reads; any other
string comes back unchanged. It never downloads, nor opens a connection: a missing snapshot
is a FileNotFoundError naming where it looked and what to run. Where the network is allowed
(an init container), the download, and the copy of one snapshot out of a shared cache:

    python -m baton.engine.models.hub download ORG/NAME [--revision R] [--cache-dir DIR]
    python -m baton.engine.models.hub copy ORG/NAME --from SRC --to DST [--revision R]

(the token of a gated model from `$HF_TOKEN`, as `huggingface_hub` reads it).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

SCHEME = "hf://"
DEFAULT_REVISION = "main"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


@dataclass(frozen=True)
class HubRef:
    repo_id: str  # "ORG/NAME"
    revision: str  # a branch, a tag or a commit

    @classmethod
    def parse(cls, uri: str, revision: str | None = None) -> HubRef:
        """`hf://ORG/NAME[@REVISION]`; ValueError naming the expected form otherwise, or
        when `revision` (`--revision`) names another revision than the URI's."""
        body = uri.removeprefix(SCHEME)
        repo_id, _, pinned = body.partition("@")
        if not uri.startswith(SCHEME) or not _REPO_ID.match(repo_id) or "@" in pinned:
            raise ValueError(f"model {uri!r}: expected hf://ORG/NAME or hf://ORG/NAME@REVISION")
        if pinned and revision and pinned != revision:
            raise ValueError(f"model {uri!r} pins revision {pinned!r} but revision="
                             f"{revision!r} was asked for; give one of them")
        return cls(repo_id, pinned or revision or DEFAULT_REVISION)


def is_repo_id(model: str) -> bool:
    """`ORG/NAME` as the hub spells repo ids (one slash, no leading `.` or `/`)."""
    return bool(_REPO_ID.match(model))


def default_hub_cache(environ: dict[str, str] | None = None) -> Path:
    """Where `huggingface_hub` keeps its cache, by its own variables."""
    env = os.environ if environ is None else environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    home = Path(env["HF_HOME"]) if env.get("HF_HOME") else Path.home() / ".cache" / "huggingface"
    return home / "hub"


def repo_dir(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def snapshot_dir(repo: Path, revision: str = DEFAULT_REVISION) -> Path:
    """The snapshot of `revision` (a commit, or a branch/tag under refs/) in a cached repo."""
    snapshots = repo / "snapshots"
    if (snapshots / revision).is_dir():
        return snapshots / revision
    ref = repo / "refs" / revision
    if ref.is_file():
        commit = ref.read_text().strip()
        if (snapshots / commit).is_dir():
            return snapshots / commit
    have = sorted(p.name for p in snapshots.iterdir()) if snapshots.is_dir() else []
    refs = sorted(p.name for p in (repo / "refs").iterdir()) if (repo / "refs").is_dir() else []
    repo_id = repo.name.removeprefix("models--").replace("--", "/", 1)
    raise FileNotFoundError(
        f"no snapshot of revision {revision!r} in {repo} (refs: {refs or 'none'}, snapshots: "
        f"{have or 'none'}). Baton never downloads weights at run time; download it first: "
        f"python -m baton.engine.models.hub download {repo_id} --revision {revision} "
        f"--cache-dir {repo.parent}")


def is_cached_repo(path: Path) -> bool:
    """A `models--ORG--NAME` directory of a hub cache (not a plain model directory)."""
    return (path / "snapshots").is_dir() and not (path / "config.json").exists()


def resolve_hub_model(model: str, cache: Path | None = None,
                      revision: str | None = None) -> str:
    """The local directory for `hf://...`, a bare repo id that is not a local path, or a
    cached repo's path; other strings unchanged. `revision`: a branch, tag or commit
    (default main); a plain local directory has none to choose. Reads the disk only."""
    if model.startswith(SCHEME):
        ref = HubRef.parse(model, revision)
        return str(snapshot_dir(repo_dir(cache or default_hub_cache(), ref.repo_id),
                                ref.revision))
    path = Path(model).expanduser()
    if path.is_dir() and is_cached_repo(path):
        return str(snapshot_dir(path, revision or DEFAULT_REVISION))
    if path.exists() or not is_repo_id(model):
        return model
    return str(_cached_snapshot(model, revision or DEFAULT_REVISION, cache))


def _cached_snapshot(repo_id: str, revision: str, cache: Path | None) -> Path:
    """A bare repo id's snapshot in the hub cache; FileNotFoundError naming every place
    looked at when it is not there."""
    where = cache or default_hub_cache()
    repo = repo_dir(where, repo_id)
    if repo.is_dir():
        return snapshot_dir(repo, revision)
    raise FileNotFoundError(
        f"model {repo_id!r} is not a local path ({Path(repo_id).absolute()} does not exist) "
        f"and not in the Hugging Face hub cache ({repo} does not exist; the cache is "
        f"{_cache_origin(cache)}). Baton never downloads weights at run time: download "
        f"them first, e.g. python -m baton.engine.models.hub download {repo_id} --revision "
        f"{revision} --cache-dir {where}, or point HF_HUB_CACHE at a cache holding them")


def _cache_origin(cache: Path | None) -> str:
    if cache is not None:
        return f"{cache}, as given"
    for var, suffix in (("HF_HUB_CACHE", ""), ("HF_HOME", "/hub")):
        if os.environ.get(var):
            return f"${var}{suffix} = {default_hub_cache()}"
    return f"{default_hub_cache()}: neither $HF_HUB_CACHE nor $HF_HOME is set"


def copy_snapshot(repo_id: str, revision: str, source: Path, dest: Path) -> Path:
    """Copy one snapshot of `repo_id` (its files, the blobs they link to and the ref naming
    it) from hub cache `source` into hub cache `dest`, keeping the layout; files already
    there are kept (a restarted copy goes on). Returns the copied snapshot directory."""
    src_repo, dst_repo = repo_dir(source, repo_id), repo_dir(dest, repo_id)
    snap = snapshot_dir(src_repo, revision)
    target = dst_repo / "snapshots" / snap.name
    for path in sorted(snap.rglob("*")):
        out = target / path.relative_to(snap)
        if path.is_dir():
            out.mkdir(parents=True, exist_ok=True)
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() and (path.parent / os.readlink(path)).resolve().is_relative_to(
                src_repo.resolve()):  # a link into blobs/: copy the blob, keep the link
            blob = path.resolve()
            dst_blob = dst_repo / blob.relative_to(src_repo.resolve())
            _copy_file(blob, dst_blob)
            if not out.is_symlink():
                out.symlink_to(os.path.relpath(dst_blob, out.parent))
        else:
            _copy_file(path, out)
    if (src_repo / "refs" / revision).is_file():
        (dst_repo / "refs").mkdir(parents=True, exist_ok=True)
        (dst_repo / "refs" / revision).write_text(snap.name)
    return target


def _copy_file(src: Path, dst: Path) -> None:
    """Copy through a temporary name, so an interrupted copy never looks complete."""
    if dst.exists() and dst.stat().st_size == src.stat().st_size:
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.partial")
    shutil.copyfile(src, tmp)
    tmp.replace(dst)


def download(repo_id: str, revision: str, cache_dir: Path) -> Path:
    """Fetch (or find, when already complete) a snapshot into `cache_dir`; its directory."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, revision=revision, cache_dir=str(cache_dir)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m baton.engine.models.hub")
    sub = parser.add_subparsers(dest="command", required=True)
    get = sub.add_parser("download", help="download a model snapshot into a hub cache")
    get.add_argument("repo_id", help="ORG/NAME")
    get.add_argument("--revision", default=DEFAULT_REVISION)
    get.add_argument("--cache-dir", type=Path, default=None,
                     help="the hub cache (default: $HF_HUB_CACHE or $HF_HOME/hub)")
    cp = sub.add_parser("copy", help="copy one snapshot from a hub cache into another")
    cp.add_argument("repo_id", help="ORG/NAME")
    cp.add_argument("--revision", default=DEFAULT_REVISION)
    cp.add_argument("--from", dest="source", type=Path, required=True, help="source cache")
    cp.add_argument("--to", dest="dest", type=Path, required=True, help="destination cache")
    args = parser.parse_args(argv)
    ref = HubRef.parse(f"{SCHEME}{args.repo_id}@{args.revision}")
    if args.command == "copy":
        path = copy_snapshot(ref.repo_id, ref.revision, args.source, args.dest)
    else:
        path = download(ref.repo_id, ref.revision, args.cache_dir or default_hub_cache())
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
