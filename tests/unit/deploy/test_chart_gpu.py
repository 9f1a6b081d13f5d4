"""charts/baton on a GPU cluster: images per block, /dev/shm, runtime class, rollout
strategy, topology spread, prefill/decode co-location, model artifacts (hf://, pvc://,
hostpath://), extra volumes / init containers / labels, tracing, and the Gateway API
objects."""

from __future__ import annotations

import pytest

from tests.unit.deploy.kube import (
    RELEASE,
    container,
    deployment,
    env_of,
    find,
    find_all,
    flag,
    helm_template,
    pod_labels,
    pod_spec,
    selects,
)

WORKERS = ("prefill", "decode")
GPU = "gpu-values.yaml"


def volumes(dep):
    return {v["name"]: v for v in pod_spec(dep)["volumes"]}


def mounts(cont):
    return {m["name"]: m for m in cont["volumeMounts"]}


# -- the GPU example --------------------------------------------------------------------------
def test_gpu_workers_request_gpus_rdma_and_nixl(renders):
    docs = renders[GPU]
    for role in WORKERS:
        dep = deployment(docs, role)
        pod, cont = pod_spec(dep), container(dep)
        assert cont["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert cont["resources"]["limits"]["rdma/ib"] == 1
        assert flag(cont["args"], "--kv-transport") == "nixl"
        assert cont["image"] == "baton:0.1.0-cuda"
        assert {"key": "nvidia.com/gpu", "operator": "Exists",
                "effect": "NoSchedule"} in pod["tolerations"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert not pod.get("hostNetwork") and pod["hostIPC"] is True
        assert pod["runtimeClassName"] == "nvidia"
        assert volumes(dep)["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
        assert mounts(cont)["shm"] == {"name": "shm", "mountPath": "/dev/shm"}
        # A full GPU cluster has no spare GPU for a surge pod: replace in place.
        assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {
            "maxSurge": 0, "maxUnavailable": 1}}
        assert flag(cont["args"], "--max-model-len") == "8192"
    # Router and planner need no CUDA: they keep the CPU image.
    router = container(deployment(docs, "router"))
    assert router["image"] == "baton:0.1.0"
    assert "nvidia.com/gpu" not in router["resources"].get("limits", {})
    assert "shm" not in volumes(deployment(docs, "router"))
    assert "shm" not in volumes(deployment(renders["defaults"], "decode"))


def test_topology_spread_gets_the_blocks_own_selector(renders):
    docs = renders[GPU]
    for component in ("router", "decode"):
        (spread,) = pod_spec(deployment(docs, component))["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname"
        assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
        for other in ("router", *WORKERS):
            assert selects(spread["labelSelector"], pod_labels(other)) == (other == component)
            assert not selects(spread["labelSelector"], pod_labels(other, release="other"))


def test_colocation_places_decode_near_prefill(renders):
    pod = pod_spec(deployment(renders[GPU], "decode"))
    rules = pod["affinity"]["podAffinity"]
    (preferred,) = rules["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred["weight"] == 100
    term = preferred["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert selects(term["labelSelector"], pod_labels("prefill"))
    assert not selects(term["labelSelector"], pod_labels("decode"))
    assert not selects(term["labelSelector"], pod_labels("prefill", release="other"))
    assert "affinity" not in pod_spec(deployment(renders[GPU], "prefill"))
    # Required, by a fabric-domain label (the RDMA example): same NVLink clique only.
    rdma = pod_spec(deployment(renders["rdma-values.yaml"], "decode"))["affinity"]
    (required,) = rdma["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required["topologyKey"] == "nvidia.com/gpu.clique"
    assert selects(required["labelSelector"], pod_labels("prefill"))


def test_colocation_keeps_the_users_affinity(helm):
    docs = helm_template(helm, sets=(
        "colocation.mode=required",
        "decode.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0]"
        ".topologyKey=kubernetes.io/hostname",
        "decode.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0]"
        ".labelSelector.matchLabels.app=x"))
    affinity = pod_spec(deployment(docs, "decode"))["affinity"]
    assert set(affinity) == {"podAffinity", "podAntiAffinity"}


# -- model artifacts ------------------------------------------------------------------------
def test_model_from_a_pvc(renders):
    dep = deployment(renders[GPU], "decode")
    assert volumes(dep)["model"]["persistentVolumeClaim"] == {"claimName": "model-weights",
                                                             "readOnly": True}
    assert mounts(container(dep))["model"] == {"name": "model", "mountPath": "/models",
                                               "readOnly": True}
    assert flag(container(dep)["args"], "--model") == "/models/Llama-3.1-8B-Instruct"


def test_model_from_a_host_path(renders):
    docs = renders["model-volume-values.yaml"]
    dep = deployment(docs, "decode")
    assert volumes(dep)["model"]["hostPath"] == {"path": "/var/lib/models/tiny",
                                                 "type": "Directory"}
    assert flag(container(dep)["args"], "--model") == "/models"
    assert pod_spec(dep)["serviceAccountName"] == "existing-sa"
    assert "ServiceAccount" not in {d["kind"] for d in docs}
    assert f"{RELEASE}-prefill" not in {d["metadata"]["name"] for d in find_all(
        docs, "Deployment")}


def test_model_from_a_host_gguf_file(helm):
    docs = helm_template(helm, sets=("model.uri=hostpath:///srv/m/tiny.Q4.gguf",))
    dep = deployment(docs, "decode")
    assert volumes(dep)["model"]["hostPath"] == {"path": "/srv/m/tiny.Q4.gguf", "type": "File"}
    assert mounts(container(dep))["model"]["mountPath"] == "/models/tiny.Q4.gguf"
    assert flag(container(dep)["args"], "--model") == "/models/tiny.Q4.gguf"


def test_model_from_the_hub_is_downloaded_by_an_init_container(renders):
    docs = renders["hf-model-values.yaml"]
    claim = find(docs, "PersistentVolumeClaim", f"{RELEASE}-models")
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["storageClassName"] == "shared-nfs"
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    for role in WORKERS:
        dep = deployment(docs, role)
        cont = container(dep)
        (init,) = pod_spec(dep)["initContainers"]
        assert init["name"] == "model-download" and init["image"] == cont["image"]
        assert init["command"] == ["python", "-m", "baton.engine.models.hub"]
        assert init["args"] == ["download", "meta-llama/Llama-3.2-1B-Instruct", "--revision",
                                "main", "--cache-dir", "/models/hub"]
        # The token from its Secret, never in args.
        assert env_of(init)["HF_TOKEN"]["valueFrom"] == {
            "secretKeyRef": {"name": "hf-token", "key": "token"}}
        assert mounts(init)["model"] == {"name": "model", "mountPath": "/models"}
        assert init["securityContext"] == cont["securityContext"]
        assert volumes(dep)["model"]["persistentVolumeClaim"] == {
            "claimName": f"{RELEASE}-models"}
        # The worker reads the hub cache offline, read-only.
        assert mounts(cont)["model"]["readOnly"] is True
        assert flag(cont["args"], "--model") == "hf://meta-llama/Llama-3.2-1B-Instruct@main"
        env = env_of(cont)
        assert env["HF_HUB_CACHE"]["value"] == "/models/hub"
        assert env["HF_HUB_OFFLINE"]["value"] == "1"
        assert "HF_TOKEN" not in env


def test_the_engine_resolves_what_the_chart_passes(renders, tmp_path):
    """The worker's --model and HF_HUB_CACHE, against a cache in the layout the init
    container's download writes (tests/unit/engine/test_hub.py covers the layout itself)."""
    from baton.engine.models.hub import resolve_hub_model

    cont = container(deployment(renders["hf-model-values.yaml"], "decode"))
    snapshot = tmp_path / "models--meta-llama--Llama-3.2-1B-Instruct" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc")
    assert resolve_hub_model(flag(cont["args"], "--model"), cache=tmp_path) == str(snapshot)


def test_hub_model_without_a_claim_downloads_per_pod(helm):
    docs = helm_template(helm, sets=("model.uri=hf://org/m", "model.storage.size=5Gi"))
    assert find_all(docs, "PersistentVolumeClaim") == []
    assert volumes(deployment(docs, "decode"))["model"] == {"name": "model",
                                                           "emptyDir": {"sizeLimit": "5Gi"}}
    docs = helm_template(helm, sets=("model.uri=hf://org/m", "model.storage.existingClaim=w"))
    assert volumes(deployment(docs, "decode"))["model"]["persistentVolumeClaim"] == {
        "claimName": "w"}


# -- extra pod fields -------------------------------------------------------------------------
def test_extra_volumes_init_containers_and_labels(renders):
    dep = deployment(renders["model-volume-values.yaml"], "decode")
    pod, cont = pod_spec(dep), container(dep)
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels["team"] == "llm"
    # Extra labels never change the selector's labels.
    assert labels["app.kubernetes.io/component"] == "decode"
    assert selects(dep["spec"]["selector"], labels)
    assert volumes(dep)["adapters"] == {"name": "adapters", "configMap": {"name": "lora-adapters"}}
    assert mounts(cont)["adapters"] == {"name": "adapters", "mountPath": "/adapters",
                                        "readOnly": True}
    assert [c["name"] for c in pod["initContainers"]] == ["wait-for-weights"]


def test_resource_claims_with_their_pod_claims(helm):
    docs = helm_template(helm, sets=("decode.resources.claims[0].name=gpu",
                                     "decode.resourceClaims[0].name=gpu",
                                     "decode.resourceClaims[0].resourceClaimTemplateName=h100"))
    dep = deployment(docs, "decode")
    assert pod_spec(dep)["resourceClaims"] == [{"name": "gpu",
                                               "resourceClaimTemplateName": "h100"}]
    assert container(dep)["resources"]["claims"] == [{"name": "gpu"}]


# -- tracing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("component", ["router", *WORKERS])
def test_tracing_reaches_router_and_workers(renders, component):
    cont = container(deployment(renders["hf-model-values.yaml"], component))
    assert flag(cont["args"], "--otlp-endpoint") == \
        "http://otel-collector.observability.svc:4318"
    env = env_of(cont)
    assert env["OTEL_TRACES_SAMPLER"]["value"] == "parentbased_traceidratio"
    assert env["OTEL_TRACES_SAMPLER_ARG"]["value"] == "0.1"
    assert env["OTEL_RESOURCE_ATTRIBUTES"]["value"] == \
        f"k8s.namespace.name=llm,service.namespace={RELEASE}"
    plain = container(deployment(renders["defaults"], component))
    assert flag(plain["args"], "--otlp-endpoint") is None
    assert not [n for n in env_of(plain) if n.startswith("OTEL_")]


# -- gateway.yaml -----------------------------------------------------------------------------
def test_inference_pool_over_the_router_pods(renders):
    docs = renders["gateway-values.yaml"]
    pool = find(docs, "InferencePool", RELEASE)
    spec = pool["spec"]
    assert selects({"matchLabels": spec["selector"]["matchLabels"]}, pod_labels("router"))
    for other in WORKERS:
        assert not selects({"matchLabels": spec["selector"]["matchLabels"]}, pod_labels(other))
    assert spec["targetPorts"] == [{"number": 8000}]
    assert spec["endpointPickerRef"] == {"kind": "Service", "name": "baton-epp",
                                         "port": {"number": 9002}, "failureMode": "FailOpen"}
    route = find(docs, "HTTPRoute", RELEASE)["spec"]
    assert route["parentRefs"] == [{"name": "inference-gateway", "namespace": "gateway-system"}]
    assert route["hostnames"] == ["llm.example.com"]
    (rule,) = route["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io",
                                    "kind": "InferencePool", "name": RELEASE}]


def test_http_route_straight_to_the_router_service(helm):
    docs = helm_template(helm, sets=("gateway.httpRoute.enabled=true",
                                     "gateway.httpRoute.parentRefs[0].name=gw"))
    assert find_all(docs, "InferencePool") == []
    (rule,) = find(docs, "HTTPRoute", RELEASE)["spec"]["rules"]
    assert rule["backendRefs"] == [{"name": f"{RELEASE}-router", "port": 8000}]


# -- tensor parallelism ----------------------------------------------------------------------
def test_tensor_parallel_pools_get_the_flag_one_gpu_per_rank_and_tcp(helm):
    """prefill at TP=2, decode at TP=1 on the GPU example: the prefill pod asks for 2 GPUs,
    passes --tensor-parallel-size 2 and opens kvPort + 1 for its rank 1; both pools move KV
    over tcp (nixl moves whole caches only)."""
    from tests.unit.deploy.kube import CI_VALUES

    gpu = next(p for p in CI_VALUES if p.name == GPU)
    docs = helm_template(helm, gpu, sets=("prefill.engine.tensorParallelSize=2",
                                          "prefill.engine.kvTransport=auto",
                                          "decode.engine.kvTransport=tcp"))
    prefill, decode = (container(deployment(docs, r)) for r in WORKERS)
    assert flag(prefill["args"], "--tensor-parallel-size") == "2"
    assert flag(decode["args"], "--tensor-parallel-size") is None
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert prefill["resources"]["limits"]["rdma/ib"] == 1  # the rest as given
    for cont in (prefill, decode):
        assert flag(cont["args"], "--kv-transport") == "tcp"
    ports = {p["name"]: p["containerPort"] for p in prefill["ports"]}
    assert ports["kv-r1"] == ports["kv"] + 1 and "kv-r1" not in {
        p["name"] for p in decode["ports"]}


def test_tensor_parallel_refuses_a_transport_other_than_tcp(helm):
    from tests.unit.deploy.kube import CHART, run

    out = run([helm, "template", "r", CHART, "--set", "decode.engine.tensorParallelSize=2",
               "--set", "prefill.engine.kvTransport=nixl"])
    assert out.returncode != 0
    assert "prefill.engine.kvTransport" in out.stderr and "tcp only" in out.stderr
    out = run([helm, "template", "r", CHART, "--set", "decode.engine.tensorParallelSize=0"])
    assert out.returncode != 0 and "tensorParallelSize" in out.stderr


def test_tensor_parallel_size_defaults_to_one(renders):
    for role in WORKERS:
        cont = container(deployment(renders["defaults"], role))
        assert flag(cont["args"], "--tensor-parallel-size") is None
        assert [p["name"] for p in cont["ports"]] == ["http", "kv"]


# -- device and GPU memory -------------------------------------------------------------------
def test_gpu_pools_run_cuda_and_size_kv_by_their_memory_fraction(renders):
    """A GPU pool says --device cuda (a pod without a usable GPU fails at start instead of
    serving on its CPU) and sizes its KV pool by its own gpuMemoryUtilization."""
    docs = renders[GPU]
    fractions = {}
    for role in WORKERS:
        args = container(deployment(docs, role))["args"]
        assert flag(args, "--device") == "cuda"
        assert flag(args, "--kv-cache-gib") is None
        fractions[role] = flag(args, "--gpu-memory-utilization")
    assert fractions == {"prefill": "0.9", "decode": "0.92"}
    # a GPU pool whose fraction is null keeps a fixed pool (the RDMA example's 60 GiB)
    rdma = container(deployment(renders["rdma-values.yaml"], "decode"))["args"]
    assert flag(rdma, "--device") == "cuda" and flag(rdma, "--kv-cache-gib") == "60"
    assert flag(rdma, "--gpu-memory-utilization") is None


def test_cpu_pools_keep_auto_and_kv_cache_gib(renders):
    for role in WORKERS:
        args = container(deployment(renders["defaults"], role))["args"]
        assert flag(args, "--device") is None and flag(args, "--gpu-memory-utilization") is None
        assert flag(args, "--kv-cache-gib") == "2"


def test_a_pool_asking_for_gpus_refuses_device_cpu_and_bad_fractions(helm):
    from tests.unit.deploy.kube import CHART, load_docs, run

    out = run([helm, "template", "r", CHART, "--set", "decode.engine.device=cpu",
               "--set", "decode.resources.limits.nvidia\\.com/gpu=1"])
    assert out.returncode != 0 and "decode.engine.device: cpu" in out.stderr
    out = run([helm, "template", RELEASE, CHART, "--set", "decode.engine.device=cuda",
               "--set-json", "decode.engine.gpuMemoryUtilization=0.45"])
    args = container(deployment(load_docs(out.stdout), "decode"))["args"]
    assert (flag(args, "--device"), flag(args, "--gpu-memory-utilization")) == ("cuda", "0.45")
    for bad in ("0", "1.5"):
        out = run([helm, "template", "r", CHART, "--set-json",
                   f"decode.engine.gpuMemoryUtilization={bad}"])
        assert out.returncode != 0 and "gpuMemoryUtilization" in out.stderr


def test_the_engine_parses_what_gpu_pools_pass(renders):
    """The worker's own parser turns a GPU pool's args into an EngineConfig on CUDA sized by
    its fraction (the flags exist and their values validate)."""
    from baton.cli import build_parser
    from baton.cli_common import engine_config

    args = container(deployment(renders[GPU], "decode"))["args"]
    config = engine_config(build_parser().parse_args(args))
    assert config.compute.device == "cuda" and config.cache.gpu_memory_utilization == 0.92
    assert config.cache.pool_fraction("cuda") == 0.92 and config.cache.kv_cache_memory_bytes is None
