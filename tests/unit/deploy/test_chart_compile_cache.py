"""charts/baton keeps Triton's compile cache of GPU worker pools (TRITON_CACHE_DIR) where a
restart finds it (`tritonCache`): the model's writable claim when there is one, else the
pod's /cache volume, or a claim / node directory of its own; CPU pools get none."""

from __future__ import annotations

import subprocess

import pytest

from tests.unit.deploy.kube import CHART, RELEASE, container, deployment, helm_template, pod_spec

WORKERS = ("prefill", "decode")
GPU = "gpu-values.yaml"
ONE_GPU = tuple(f"{role}.resources.limits.nvidia\\.com/gpu=1" for role in WORKERS)
HF_CLAIM = ("model.uri=hf://Qwen/Qwen3-0.6B", "model.storage.create=true")


def triton_dir(dep) -> str | None:
    env = {e["name"]: e.get("value") for e in container(dep)["env"]}
    return env.get("TRITON_CACHE_DIR")


def mount_at(dep, path: str) -> dict | None:
    return next((m for m in container(dep)["volumeMounts"] if m["mountPath"] == path), None)


def volume(dep, name: str) -> dict:
    return next(v for v in pod_spec(dep)["volumes"] if v["name"] == name)


def test_cpu_pools_get_no_triton_cache(renders):
    for role in WORKERS:
        dep = deployment(renders["defaults"], role)
        assert triton_dir(dep) is None
        assert mount_at(dep, "/triton-cache") is None


def test_gpu_example_keeps_the_cache_on_the_cache_volume(renders):
    # The example's weights are a read-only claim: auto falls back to /cache (an emptyDir
    # that outlives container restarts), which the image's TRITON_CACHE_DIR also names.
    for role in WORKERS:
        dep = deployment(renders[GPU], role)
        assert triton_dir(dep) == "/cache/triton"
        assert mount_at(dep, "/cache")["name"] == "cache"


def test_auto_reuses_the_models_writable_claim(helm):
    docs = helm_template(helm, sets=(*HF_CLAIM, *ONE_GPU))
    for role in WORKERS:
        dep = deployment(docs, role)
        assert triton_dir(dep) == "/triton-cache"
        mount = mount_at(dep, "/triton-cache")
        assert mount == {"name": "model", "mountPath": "/triton-cache", "subPath": "triton"}
        assert volume(dep, "model")["persistentVolumeClaim"]["claimName"] == f"{RELEASE}-models"
        assert mount_at(dep, "/models")["readOnly"] is True  # the weights stay read-only


def test_a_pool_on_cuda_without_a_gpu_resource_counts_as_gpu(helm):
    try:
        docs = helm_template(helm, sets=("decode.engine.device=cuda",))
    except AssertionError as err:  # a chart without engine.device rejects the value
        pytest.skip(f"engine.device is not a chart value here: {err}")
    assert triton_dir(deployment(docs, "decode")) == "/cache/triton"
    assert triton_dir(deployment(docs, "prefill")) is None


@pytest.mark.parametrize("sets, source, sub_path", [
    (("tritonCache.type=pvc", "tritonCache.claimName=triton"),
     {"persistentVolumeClaim": {"claimName": "triton"}}, "triton"),
    (("tritonCache.type=hostPath",),
     {"hostPath": {"path": "/var/cache/baton/triton", "type": "DirectoryOrCreate"}}, None)])
def test_a_cache_volume_of_its_own(helm, sets, source, sub_path):
    docs = helm_template(helm, sets=(*sets, *ONE_GPU))
    for role in WORKERS:
        dep = deployment(docs, role)
        assert triton_dir(dep) == "/triton-cache"
        assert volume(dep, "triton-cache") == {"name": "triton-cache", **source}
        mount = mount_at(dep, "/triton-cache")
        assert mount["name"] == "triton-cache" and mount.get("subPath") == sub_path
    # CPU pools never get the volume.
    cpu = helm_template(helm, sets=sets)
    assert all(v["name"] != "triton-cache" for v in pod_spec(deployment(cpu, "decode"))["volumes"])


def test_emptydir_type_uses_the_cache_volume(helm):
    docs = helm_template(helm, sets=("tritonCache.type=emptyDir", *HF_CLAIM, *ONE_GPU))
    assert triton_dir(deployment(docs, "decode")) == "/cache/triton"
    assert mount_at(deployment(docs, "decode"), "/triton-cache") is None


@pytest.mark.parametrize("sets, message", [
    (("tritonCache.type=pvc",), "tritonCache.claimName"),
    (("tritonCache.type=hostPath", "tritonCache.hostPath="), "tritonCache.hostPath"),
    (("tritonCache.type=nfs",), "tritonCache"),
])
def test_bad_values_fail_with_the_field(helm, sets, message):
    cmd = [helm, "template", RELEASE, str(CHART), *(a for s in (*sets, *ONE_GPU)
                                                     for a in ("--set", s))]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and message in out.stderr, out.stderr
