"""k8s/: the base is the chart's default render without helm's labels, and every
kustomization (base and overlays) builds into documents valid for Kubernetes 1.29 and 1.37;
the overlays change what they say they change."""

from __future__ import annotations

from tests.unit.deploy.kube import (
    HELM_LABELS,
    OVERLAYS,
    RELEASE,
    container,
    find,
    find_all,
    flag,
    run,
    strip_helm_labels,
    validation_problems,
)

WORKERS = ("prefill", "decode")


def test_helm_and_kubectl_are_the_pinned_versions(helm, kubectl):
    out = run([helm, "version", "--template", "{{.Version}}"])
    assert out.stdout.strip() == "v4.3.1"
    out = run([kubectl, "version", "--client", "-o", "yaml"])
    assert "gitVersion: v1.37" in out.stdout


def test_every_build_validates(builds):
    assert set(builds) == {"base", "cpu-demo", "gpu"} == {"base", *(o.name for o in OVERLAYS)}
    for name, docs in builds.items():
        assert len(docs) >= 18, name
        assert validation_problems(docs) == [], name


def secret_values_hidden(doc: dict) -> dict:
    """A Secret with its values blanked: the chart draws random ones on each render, the base
    holds placeholders (k8s/base/secrets.yaml says to replace them)."""
    if doc["kind"] != "Secret":
        return doc
    return {**doc, "data": {k: "" for k in doc["data"]}}


def test_base_is_the_chart_with_default_values(builds, renders):
    def key(doc):
        return doc["kind"], doc["metadata"]["name"]

    chart = {key(d): secret_values_hidden(strip_helm_labels(d)) for d in renders["defaults"]}
    base = {key(d): secret_values_hidden(d) for d in builds["base"]}
    assert base.keys() == chart.keys()
    for k in chart:
        assert base[k] == chart[k], f"k8s/base differs from the chart for {k}"


def test_base_secrets_are_marked_placeholders(builds):
    import base64

    secrets = find_all(builds["base"], "Secret")
    assert {s["metadata"]["name"] for s in secrets} == {f"{RELEASE}-internal", f"{RELEASE}-redis"}
    for secret in secrets:
        for value in secret["data"].values():
            text = base64.b64decode(value).decode()
            assert text.startswith("REPLACE") and len(text) >= 16  # auth.py's minimum


def test_no_helm_labels_in_plain_manifests(builds):
    def labels(obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                if k == "labels":
                    yield from v
                yield from labels(v)
        elif isinstance(obj, list):
            for v in obj:
                yield from labels(v)

    for name, docs in builds.items():
        found = {label for doc in docs for label in labels(doc)}
        assert not found & set(HELM_LABELS), name


def worker(docs, role):
    dep = find(docs, "Deployment", f"{RELEASE}-{role}")
    return dep, dep["spec"]["template"]["spec"], container(dep)


def test_cpu_demo_overlay(builds):
    docs = builds["cpu-demo"]
    for role in WORKERS:
        dep, pod, cont = worker(docs, role)
        assert dep["spec"]["replicas"] == 1
        assert flag(cont["args"], "--kv-transport") == "tcp"
        assert flag(cont["args"], "--kv-cache-gib") == "0.5"
        assert cont["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"},
                                     "limits": {"memory": "3Gi"}}
        assert "tolerations" not in pod and cont["image"] == "baton:0.1.0"
    for dep in find_all(docs, "Deployment"):
        for cont in dep["spec"]["template"]["spec"]["containers"]:
            assert not any("gpu" in r for r in cont["resources"].get("limits", {}))


def test_gpu_overlay_requests_gpus_and_nixl(builds):
    docs = builds["gpu"]
    for role in WORKERS:
        dep, pod, cont = worker(docs, role)
        assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
        assert cont["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert cont["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert flag(cont["args"], "--kv-transport") == "nixl"
        # on the GPU, not a silent CPU fallback; the KV pool sized by the GPU's memory
        assert flag(cont["args"], "--device") == "cuda"
        assert flag(cont["args"], "--gpu-memory-utilization") == "0.9"
        assert flag(cont["args"], "--kv-cache-gib") is None
        assert cont["image"] == "baton:0.1.0-cuda"
        assert {"key": "nvidia.com/gpu", "operator": "Exists",
                "effect": "NoSchedule"} in pod["tolerations"]
        names = [e["name"] for e in cont["env"]]
        assert "UCX_TLS" in names and "POD_IP" in names  # the patch merged, not replaced
        assert flag(cont["args"], "--role") == role
        assert {"name": "shm", "mountPath": "/dev/shm"} in cont["volumeMounts"]
        assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in \
            pod["volumes"]
        assert {"name": "tuning", "configMap": {"name": f"{RELEASE}-tuning"}} in pod["volumes"]
    # The router needs no CUDA: it keeps the CPU image.
    router = container(find(docs, "Deployment", f"{RELEASE}-router"))
    assert router["image"] == "baton:0.1.0"
    assert "nvidia.com/gpu" not in router["resources"].get("limits", {})
    redis = container(find(docs, "Deployment", f"{RELEASE}-redis"))
    assert redis["image"] == "valkey/valkey:8-alpine"


def test_overlays_keep_security_and_tuning(builds):
    for name, docs in builds.items():
        for dep in find_all(docs, "Deployment"):
            for cont in dep["spec"]["template"]["spec"]["containers"]:
                assert cont["securityContext"]["readOnlyRootFilesystem"] is True, name
                assert cont["securityContext"]["runAsNonRoot"] is True, name
            if dep["metadata"]["name"].endswith(("-router", "-prefill", "-decode")):
                mounts = {m["name"]: m for m in container(dep)["volumeMounts"]}
                assert "subPath" not in mounts["tuning"]
        assert find(docs, "ConfigMap", f"{RELEASE}-tuning")
        assert len(find_all(docs, "NetworkPolicy")) == 4
