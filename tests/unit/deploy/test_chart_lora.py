"""charts/baton with LoRA adapters named `hf://` in the tuning file's worker.lora_modules:
downloaded at a pod's start beside an hf:// model (one init container each, into the model's
volume, read offline from it), read from `model.cache`, refused with any other model source;
the pods roll when that list changes (adapters on volumes load live, without a roll)."""

from __future__ import annotations

import subprocess

import pytest

from tests.unit.deploy.kube import CHART, RELEASE, deployment, helm_template, pod_spec

WORKERS = ("prefill", "decode")
ADAPTERS = ("tuning.worker.lora_modules.sql=hf://Org/sql-lora@v2",
            "tuning.worker.lora_modules.chat=hf://Org/chat-lora",
            "tuning.worker.lora_modules.local=/adapters/local")


def downloads(dep) -> list[tuple[str, list[str]]]:
    return [(c["name"], c["args"]) for c in pod_spec(dep).get("initContainers", [])]


def annotations(dep) -> dict:
    return dep["spec"]["template"]["metadata"].get("annotations", {})


def test_hf_adapters_download_beside_an_hf_model(helm):
    docs = helm_template(helm, sets=("model.uri=hf://Org/Model", "model.revision=r1", *ADAPTERS))
    for role in WORKERS:
        dep = deployment(docs, role)
        cache = ["--cache-dir", "/models/hub"]
        assert downloads(dep) == [
            ("model-download", ["download", "Org/Model", "--revision", "r1", *cache]),
            ("lora-download-1", ["download", "Org/chat-lora", "--revision", "main", *cache]),
            ("lora-download-2", ["download", "Org/sql-lora", "--revision", "v2", *cache])]
        for c in pod_spec(dep)["initContainers"]:  # all into the model's volume
            assert {"name": "model", "mountPath": "/models"} in c["volumeMounts"]
    rolled = helm_template(helm, sets=("model.uri=hf://Org/Model", "model.revision=r1",
                                       *ADAPTERS[:2], "tuning.worker.lora_modules.local=/b"))
    other = helm_template(helm, sets=("model.uri=hf://Org/Model", "model.revision=r1",
                                      *ADAPTERS[1:]))
    key = "checksum/lora-downloads"
    checksum = annotations(deployment(docs, "decode"))[key]
    # a volume adapter changed: no roll (it loads live); an hf:// one dropped: a roll
    assert annotations(deployment(rolled, "decode"))[key] == checksum
    assert annotations(deployment(other, "decode"))[key] != checksum


def test_hf_adapters_are_read_from_a_hub_cache(helm):
    docs = helm_template(helm, sets=("model.name=Qwen/Qwen3-0.6B", "model.cache.pvc=hf-cache",
                                     *ADAPTERS))
    for role in WORKERS:
        assert not downloads(deployment(docs, role))  # nothing downloads: the cache has them


def test_no_hf_adapters_no_downloads_and_no_annotation(helm):
    docs = helm_template(helm, sets=("model.uri=hf://Org/Model", ADAPTERS[2]))
    dep = deployment(docs, "decode")
    assert [name for name, _ in downloads(dep)] == ["model-download"]
    assert "checksum/lora-downloads" not in annotations(dep)


@pytest.mark.parametrize("source", [(), ("model.uri=pvc://claim/m",)])
def test_hf_adapters_need_a_hub_cache(helm, source):
    cmd = [helm, "template", RELEASE, CHART]
    for s in (*source, ADAPTERS[0]):
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode != 0 and "hf:// adapters need model.uri hf://" in out.stderr
