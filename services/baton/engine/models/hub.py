"""Model weights in a Hugging Face hub cache: `hf://ORG/NAME[@REVISION]` resolved offline, and
the download the Helm chart's init container runs before a worker starts.

The cache layout is the one `huggingface_hub` writes (`snapshot_download(cache_dir=...)`):

    <cache>/models--ORG--NAME/refs/REVISION            the commit a branch or tag points at
    <cache>/models--ORG--NAME/snapshots/COMMIT/...      the files (links into blobs/)

`resolve_hub_model(model)` turns `hf://ORG/NAME[@REVISION]` (looked up in the hub cache:
`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`) or the path of a
`models--ORG--NAME` directory into the snapshot directory the loader reads; any other string
comes back unchanged. It never downloads: a missing snapshot is a FileNotFoundError saying
what to run. The download, where the network is allowed (an init container):

    python -m baton.engine.models.hub download ORG/NAME [--revision R] [--cache-dir DIR]

(the token of a gated model from `$HF_TOKEN`, as `huggingface_hub` reads it).
"""

from __future__ import annotations

import argparse
import os
import re
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
    def parse(cls, uri: str) -> HubRef:
        """`hf://ORG/NAME[@REVISION]`; ValueError naming the expected form otherwise."""
        body = uri.removeprefix(SCHEME)
        repo_id, _, revision = body.partition("@")
        if not uri.startswith(SCHEME) or not _REPO_ID.match(repo_id) or "@" in revision:
            raise ValueError(f"model {uri!r}: expected hf://ORG/NAME or hf://ORG/NAME@REVISION")
        return cls(repo_id, revision or DEFAULT_REVISION)


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
    raise FileNotFoundError(
        f"no snapshot of revision {revision!r} in {repo} (refs: {refs or 'none'}, snapshots: "
        f"{have or 'none'}); download it first: python -m baton.engine.models.hub download "
        f"ORG/NAME --revision {revision} --cache-dir {repo.parent}")


def is_cached_repo(path: Path) -> bool:
    """A `models--ORG--NAME` directory of a hub cache (not a plain model directory)."""
    return (path / "snapshots").is_dir() and not (path / "config.json").exists()


def resolve_hub_model(model: str, cache: Path | None = None) -> str:
    """The local directory for `hf://...` or a cached repo's path; other strings unchanged."""
    if model.startswith(SCHEME):
        ref = HubRef.parse(model)
        return str(snapshot_dir(repo_dir(cache or default_hub_cache(), ref.repo_id),
                                ref.revision))
    path = Path(model).expanduser()
    if path.is_dir() and is_cached_repo(path):
        return str(snapshot_dir(path))
    return model


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
    args = parser.parse_args(argv)
    ref = HubRef.parse(f"{SCHEME}{args.repo_id}@{args.revision}")
    path = download(ref.repo_id, ref.revision, args.cache_dir or default_hub_cache())
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
