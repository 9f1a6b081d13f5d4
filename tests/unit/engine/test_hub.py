"""Model snapshots in a Hugging Face hub cache (`baton.engine.models.hub`): `hf://` URIs and
`models--ORG--NAME` directories resolve offline to the snapshot the loader reads, in the
layout huggingface_hub itself writes and reads back."""

from __future__ import annotations

import json

import pytest

from baton.engine.models.hub import HubRef, default_hub_cache, main, resolve_hub_model
from baton.engine.models.loader import resolve_model_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD = "fedcba9876543210fedcba9876543210fedcba98"


def make_cache(root, repo_id="org/tiny-llama"):
    """A hub cache holding one repo: `main` and tag `v1` at COMMIT, an older snapshot OLD."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    for commit in (COMMIT, OLD):
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(json.dumps({"commit": commit}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v1").write_text(COMMIT + "\n")
    return repo


def test_uri_parsing():
    assert HubRef.parse("hf://org/name") == HubRef("org/name", "main")
    assert HubRef.parse("hf://Org-1/Llama-3.1_8B@v2.0") == HubRef("Org-1/Llama-3.1_8B", "v2.0")
    for bad in ("hf://name", "hf://a/b/c", "hf://org/@x", "org/name", "hf://org/n@a@b"):
        with pytest.raises(ValueError, match="expected hf://ORG/NAME"):
            HubRef.parse(bad)


@pytest.mark.parametrize("uri, commit", [("hf://org/tiny-llama", COMMIT),
                                         ("hf://org/tiny-llama@v1", COMMIT),
                                         (f"hf://org/tiny-llama@{OLD}", OLD)])
def test_hf_uri_resolves_to_its_snapshot(tmp_path, uri, commit):
    make_cache(tmp_path)
    path = resolve_hub_model(uri, cache=tmp_path)
    assert path == str(tmp_path / "models--org--tiny-llama" / "snapshots" / commit)


def test_cache_location_follows_huggingface_hub_variables(tmp_path, monkeypatch):
    assert default_hub_cache({"HF_HUB_CACHE": "/c"}).as_posix() == "/c"
    assert default_hub_cache({"HF_HOME": "/h"}).as_posix() == "/h/hub"
    make_cache(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    # The loader's own entry point: what `--model hf://...` reaches in a worker.
    assert resolve_model_dir("hf://org/tiny-llama") == \
        tmp_path / "models--org--tiny-llama" / "snapshots" / COMMIT


def test_a_cached_repo_directory_resolves_to_main(tmp_path):
    repo = make_cache(tmp_path)
    assert resolve_model_dir(str(repo)) == repo / "snapshots" / COMMIT
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    assert resolve_model_dir(str(plain)) == plain  # an ordinary model directory is untouched


def test_missing_snapshot_says_what_to_download(tmp_path):
    make_cache(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"revision 'v9'.*refs: \['main', 'v1'\].*"
                                                r"never downloads.*hub download "
                                                r"org/tiny-llama --revision v9"):
        resolve_hub_model("hf://org/tiny-llama@v9", cache=tmp_path)
    with pytest.raises(FileNotFoundError, match="no snapshot of revision 'main'"):
        resolve_hub_model("hf://org/absent", cache=tmp_path)


def test_download_reads_back_a_complete_snapshot_offline(tmp_path, monkeypatch, capsys):
    """The init container's command on a cache huggingface_hub already holds: with the hub
    offline it finds the snapshot our resolver finds (same layout both ways)."""
    make_cache(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert main(["download", "org/tiny-llama", "--cache-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == resolve_hub_model("hf://org/tiny-llama", cache=tmp_path)


def test_a_bare_repo_id_resolves_like_its_hf_uri(tmp_path, monkeypatch):
    make_cache(tmp_path)
    monkeypatch.chdir(tmp_path)
    snapshots = tmp_path / "models--org--tiny-llama" / "snapshots"
    assert resolve_hub_model("org/tiny-llama", cache=tmp_path) == str(snapshots / COMMIT)
    assert resolve_hub_model("org/tiny-llama", cache=tmp_path, revision="v1") == \
        str(snapshots / COMMIT)
    assert resolve_hub_model("org/tiny-llama", cache=tmp_path, revision=OLD) == \
        str(snapshots / OLD)
    for other in ("plain-name", "./org/tiny-llama", "/abs/path", "a/b/c", "model.gguf"):
        assert resolve_hub_model(other, cache=tmp_path) == other  # not a repo id: unchanged


def test_without_variables_the_cache_is_under_home(tmp_path, monkeypatch):
    for var in ("HF_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    make_cache(tmp_path / ".cache" / "huggingface" / "hub")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir("org/tiny-llama").name == COMMIT
    with pytest.raises(FileNotFoundError, match=r"neither \$HF_HUB_CACHE nor \$HF_HOME"):
        resolve_model_dir("org/absent")


def test_copy_takes_one_snapshot_and_keeps_the_layout(tmp_path, capsys):
    """The chart's init copy: one revision's files, the blobs they link to and its ref,
    into another cache that then resolves to the same files."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    repo = make_cache(src)
    snap = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir()
    (repo / "blobs" / "abc").write_bytes(b"weights")
    (snap / "sub").mkdir()
    (snap / "sub" / "model.safetensors").symlink_to("../../../blobs/abc")
    assert main(["copy", "org/tiny-llama", "--revision", "v1", "--from", str(src),
                 "--to", str(dst)]) == 0
    copied = dst / "models--org--tiny-llama"
    assert capsys.readouterr().out.strip() == str(copied / "snapshots" / COMMIT)
    assert resolve_hub_model("hf://org/tiny-llama@v1", cache=dst) == \
        str(copied / "snapshots" / COMMIT)
    link = copied / "snapshots" / COMMIT / "sub" / "model.safetensors"
    assert link.is_symlink() and link.read_bytes() == b"weights"
    assert (copied / "blobs" / "abc").read_bytes() == b"weights"
    assert not (copied / "snapshots" / OLD).exists()  # only the revision asked for
    assert not (copied / "refs" / "main").exists()
    assert main(["copy", "org/tiny-llama", "--revision", "v1", "--from", str(src),
                 "--to", str(dst)]) == 0  # again: nothing to do, same result
    with pytest.raises(FileNotFoundError, match="no snapshot of revision 'v9'"):
        main(["copy", "org/tiny-llama", "--revision", "v9", "--from", str(src),
              "--to", str(dst)])
