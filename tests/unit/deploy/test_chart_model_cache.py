"""charts/baton with the model named by its Hugging Face repo id and read from a hub cache
volume (`model.cache`): read-only and offline, optionally copied into the pod first
(`model.cache.initCopy`), and the names it is served under (`model.servedModelNames`)."""

from __future__ import annotations

import subprocess

import pytest

from tests.unit.deploy.kube import (
    CHART,
    RELEASE,
    container,
    deployment,
    env_of,
    flag,
    helm_template,
    pod_spec,
)

WORKERS = ("prefill", "decode")
QWEN = ("model.name=Qwen/Qwen3-0.6B", "model.revision=v1")


def volumes(dep):
    return {v["name"]: v for v in pod_spec(dep)["volumes"]}


def mounts(cont):
    return {m["name"]: m for m in cont["volumeMounts"]}


def values_after(args: list[str], name: str) -> list[str]:
    """The values of a flag taking several (up to the next --flag)."""
    rest = args[args.index(name) + 1:]
    return rest[:next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]


@pytest.mark.parametrize("source, volume", [
    ("model.cache.pvc=hf-cache", {"persistentVolumeClaim": {"claimName": "hf-cache",
                                                             "readOnly": True}}),
    ("model.cache.hostPath=/data/hf/hub", {"hostPath": {"path": "/data/hf/hub",
                                                        "type": "Directory"}})])
def test_a_repo_id_is_served_from_a_read_only_hub_cache(helm, source, volume):
    docs = helm_template(helm, sets=(*QWEN, source))
    for role in WORKERS:
        dep = deployment(docs, role)
        cont = container(dep)
        assert flag(cont["args"], "--model") == "Qwen/Qwen3-0.6B"
        assert flag(cont["args"], "--revision") == "v1"
        assert values_after(cont["args"], "--served-model-name") == ["Qwen/Qwen3-0.6B"]
        assert {k: v for k, v in volumes(dep)["model"].items() if k != "name"} == volume
        assert mounts(cont)["model"] == {"name": "model", "mountPath": "/models/hub",
                                         "readOnly": True}
        env = env_of(cont)
        assert env["HF_HUB_CACHE"]["value"] == "/models/hub"
        assert env["HF_HUB_OFFLINE"]["value"] == "1"
        assert not pod_spec(dep).get("initContainers")  # nothing downloads, nothing copies


def test_the_init_copy_fills_the_pods_own_volume_from_the_cache(helm):
    docs = helm_template(helm, sets=(*QWEN, "model.cache.pvc=shared-hf",
                                     "model.cache.initCopy.enabled=true",
                                     "model.cache.initCopy.size=7Gi"))
    for role in WORKERS:
        dep = deployment(docs, role)
        cont, vols = container(dep), volumes(dep)
        (init,) = pod_spec(dep)["initContainers"]
        assert init["name"] == "model-copy" and init["image"] == cont["image"]
        assert init["command"] == ["python", "-m", "baton.engine.models.hub"]
        assert init["args"] == ["copy", "Qwen/Qwen3-0.6B", "--revision", "v1",
                                "--from", "/hf-source", "--to", "/models/hub"]
        assert mounts(init)["model-source"] == {"name": "model-source",
                                                "mountPath": "/hf-source", "readOnly": True}
        assert mounts(init)["model"] == {"name": "model", "mountPath": "/models/hub"}
        assert init["securityContext"] == cont["securityContext"]
        assert vols["model-source"]["persistentVolumeClaim"] == {"claimName": "shared-hf",
                                                                 "readOnly": True}
        assert vols["model"]["emptyDir"] == {"sizeLimit": "7Gi"}
        assert "model-source" not in mounts(cont)  # the worker reads the copy only
        assert mounts(cont)["model"]["readOnly"] is True
    claim = helm_template(helm, sets=(*QWEN, "model.cache.hostPath=/nfs/hub",
                                      "model.cache.initCopy.enabled=true",
                                      "model.cache.initCopy.claim=local-models"))
    vols = volumes(deployment(claim, "decode"))
    assert vols["model"]["persistentVolumeClaim"] == {"claimName": "local-models"}
    assert vols["model-source"]["hostPath"] == {"path": "/nfs/hub", "type": "Directory"}


def test_the_chart_copy_and_resolution_meet_in_the_same_place(helm, tmp_path):
    """The init container's copy, run here against a hub cache, then the worker's --model and
    --revision resolved in the copy as the engine does with HF_HUB_CACHE."""
    from baton.engine.models.hub import main, resolve_hub_model

    dep = deployment(helm_template(helm, sets=(*QWEN, "model.cache.pvc=c",
                                               "model.cache.initCopy.enabled=true")), "decode")
    (init,), cont = pod_spec(dep)["initContainers"], container(dep)
    repo = tmp_path / "src" / "models--Qwen--Qwen3-0.6B"
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "snapshots" / "abc" / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "v1").write_text("abc")
    args = [{"/hf-source": str(tmp_path / "src"), "/models/hub": str(tmp_path / "dst")}.get(a, a)
            for a in init["args"]]
    assert main(args) == 0
    resolved = resolve_hub_model(flag(cont["args"], "--model"), cache=tmp_path / "dst",
                                 revision=flag(cont["args"], "--revision"))
    assert resolved == str(tmp_path / "dst" / "models--Qwen--Qwen3-0.6B" / "snapshots" / "abc")


def test_served_model_names_come_from_values(helm):
    docs = helm_template(helm, sets=("model.servedModelNames={qwen,qwen-latest}",))
    args = container(deployment(docs, "decode"))["args"]
    assert values_after(args, "--served-model-name") == ["qwen", "qwen-latest"]
    default = container(deployment(helm_template(helm), "decode"))["args"]
    assert values_after(default, "--served-model-name") == ["SmolLM2-135M-Instruct"]
    assert flag(default, "--revision") is None  # the bundled model has none


@pytest.mark.parametrize("sets, error", [
    (("model.cache.pvc=a", "model.cache.hostPath=/b"), "set pvc or hostPath, not both"),
    (("model.cache.pvc=a", "model.uri=hf://org/m"), "not model.uri"),
    (("model.cache.pvc=a",), "must be the model's repo id"),  # the default name is not one
    (("model.cache.hostPath=relative/dir", "model.name=o/m"), "hostPath"),
    (("model.servedModelNames={a,a}",), "servedModelNames"),
])
def test_bad_cache_values_are_refused(helm, sets, error):
    cmd = [helm, "template", RELEASE, CHART]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode != 0 and error in out.stderr, out.stderr
