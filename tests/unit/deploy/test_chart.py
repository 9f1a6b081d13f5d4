"""charts/baton: lint and schema, every rendered document valid for Kubernetes 1.29 and 1.37
(custom resources against their CRDs' schemas), bad values refused with the field named, and
what the core templates render (commands, probes and drain, tuning, Services, budgets,
Redis, NOTES). Scaling, security and GPU features have their own files."""

from __future__ import annotations

import tarfile

import pytest
import yaml

from baton.common.tuning import parse_tuning
from tests.unit.deploy.kube import (
    BAD_VALUES,
    CHART,
    CI_VALUES,
    NAMESPACE,
    RELEASE,
    container,
    deployment,
    env_of,
    find,
    find_all,
    flag,
    names,
    pod_labels,
    pod_spec,
    run,
    selects,
    validation_problems,
)

WORKERS = ("prefill", "decode")
COMPONENTS = ("router", *WORKERS)


def args_of(docs, component):
    return container(deployment(docs, component))["args"]


# -- lint, schema, validity -------------------------------------------------------------
@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name)
def test_lint_strict_passes(helm, values):
    out = run([helm, "lint", "--strict", CHART, "-f", values])
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_rendered_document_validates(renders):
    assert set(renders) == {"defaults", *(p.name for p in CI_VALUES)}
    kinds = set()
    for name, docs in renders.items():
        assert docs, name
        assert validation_problems(docs) == [], name
        kinds |= {d["kind"] for d in docs}
    # The custom resources are validated too (tests/unit/deploy/crds.py), not skipped.
    assert {"ServiceMonitor", "PrometheusRule", "ScaledObject", "InferencePool",
            "HTTPRoute", "HorizontalPodAutoscaler"} <= kinds


def test_custom_resources_are_checked_strictly(renders):
    docs = renders["autoscaling-values.yaml"] + renders["gateway-values.yaml"]
    for kind in ("ScaledObject", "ServiceMonitor", "PrometheusRule", "InferencePool",
                 "HTTPRoute"):
        (doc,) = find_all(docs, kind)
        broken = yaml.safe_load(yaml.safe_dump(doc))
        broken["spec"]["replicaz"] = 1
        assert any("replicaz" in p for p in validation_problems([broken])), kind
    pool = yaml.safe_load(yaml.safe_dump(find_all(docs, "InferencePool")[0]))
    del pool["spec"]["endpointPickerRef"]
    assert any("endpointPickerRef" in p for p in validation_problems([pool]))


# Each bad values file and the field its error must name (not just "invalid").
BAD_FIELDS = {
    "replicas-string-values.yaml": "/prefill/replicas",
    "unknown-key-values.yaml": "kvTransprot",
    "autoscaling-kind-values.yaml": "/decode/autoscaling/kind",
    "colocation-values.yaml": "/colocation/mode",
    "colocation-without-prefill-values.yaml": "colocation.mode",
    "drain-values.yaml": "/drain/timeoutSeconds",
    "external-redis-values.yaml": "redis.external",
    "extra-volume-mounts-values.yaml": "/router/extraVolumeMounts/0",
    "hostnetwork-ports-values.yaml": "decode.port",
    "hpa-min-values.yaml": "decode.autoscaling.minReplicas",
    "image-pull-policy-values.yaml": "/decode/image/pullPolicy",
    "inference-pool-values.yaml": "gateway.inferencePool.endpointPicker.name",
    "init-containers-values.yaml": "/prefill/initContainers/0",
    "keda-server-values.yaml": "decode.autoscaling.keda.serverAddress",
    "model-storage-values.yaml": "/model/storage/accessModes/0",
    "model-uri-values.yaml": "/model/uri",
    "planner-and-keda-values.yaml": "prefill.autoscaling.kind",
    "pod-labels-values.yaml": "/router/podLabels/tier",
    "redis-prefix-values.yaml": "/redis/prefix",
    "resource-claims-values.yaml": "decode.resources.claims",
    "runtime-class-values.yaml": "/prefill/runtimeClassName",
    "secret-key-values.yaml": "/internalToken/key",
    "security-context-values.yaml": "capabilites",
    "shm-size-values.yaml": "/prefill/shm/size",
    "strategy-values.yaml": "/router/strategy/type",
    "topology-spread-values.yaml": "/decode/topologySpreadConstraints/0",
    "tracing-values.yaml": "/tracing/samplerRatio",
}


def test_every_bad_values_file_names_its_field():
    assert set(BAD_FIELDS) == {p.name for p in BAD_VALUES}


# Combinations the schema cannot express are refused by a template's `fail`, which helm
# lint only logs (it renders with a lenient `fail`); template and install refuse them.
REFUSED_BY_TEMPLATES = {
    "colocation-without-prefill-values.yaml", "external-redis-values.yaml",
    "hostnetwork-ports-values.yaml", "hpa-min-values.yaml", "inference-pool-values.yaml",
    "keda-server-values.yaml", "planner-and-keda-values.yaml", "resource-claims-values.yaml"}


@pytest.mark.parametrize("values", BAD_VALUES, ids=lambda p: p.name)
def test_bad_values_are_refused_naming_the_field(helm, values):
    field = BAD_FIELDS[values.name]
    if values.name not in REFUSED_BY_TEMPLATES:
        lint = run([helm, "lint", "--strict", CHART, "-f", values])
        assert lint.returncode != 0 and field in lint.stdout + lint.stderr
    template = run([helm, "template", RELEASE, CHART, "-f", values])
    assert template.returncode != 0 and field in template.stderr, template.stderr
    install = run([helm, "install", RELEASE, CHART, "--dry-run=client", "-f", values])
    assert install.returncode != 0 and field in install.stderr, install.stderr


def test_conflicting_values_are_refused(helm):
    for sets, message in (
            (["router.apiKey.existingSecret=a", "router.apiKey.value=b"], "router.apiKey"),
            (["model.uri=hf://o/m", "model.storage.create=true",
              "model.storage.existingClaim=c"], "model.storage"),
            (["redis.enabled=false"], "redis.external.existingSecret"),
            (["decode.hostNetwork=true"], "decode.hostNetwork"),
            (["planner.enabled=true"], "planner.profile"),
            (["planner.enabled=true", "planner.profile=x", "prefill.enabled=false"],
             "planner.enabled needs prefill.enabled"),
            (["gateway.httpRoute.enabled=true"], "gateway.httpRoute.parentRefs")):
        cmd = [helm, "template", RELEASE, CHART]
        for s in sets:
            cmd += ["--set", s]
        out = run(cmd)
        assert out.returncode != 0 and message in out.stderr, (sets, out.stderr)
    out = run([helm, "template", RELEASE, CHART, "--set", "decode.hostNetwork=true",
               "--set", "networkPolicy.enabled=false"])
    assert out.returncode == 0, out.stderr


def test_chart_packages_without_the_bad_values(helm, tmp_path):
    out = run([helm, "package", CHART, "--destination", tmp_path])
    assert out.returncode == 0, out.stderr
    (archive,) = tmp_path.glob("baton-*.tgz")
    with tarfile.open(archive) as tar:
        members = tar.getnames()
    assert "baton/values.schema.json" in members and "baton/files/alerts.yaml" in members
    assert not [m for m in members if "ci-bad" in m]


# -- commands (router-deployment.yaml, worker-deployment.yaml) -----------------------------
def test_router_command(renders):
    docs = renders["defaults"]
    cont = container(deployment(docs, "router"))
    assert cont["command"] == ["baton"] and cont["args"][0] == "router"
    # The registry comes from $BATON_REDIS_URL (a Secret), never from the arguments.
    assert flag(cont["args"], "--registry") is None
    assert flag(cont["args"], "--registry-prefix") == f"{NAMESPACE}/{RELEASE}"
    assert flag(cont["args"], "--port") == "8000" and flag(cont["args"], "--host") == "0.0.0.0"
    assert flag(cont["args"], "--policy") == "load"
    assert flag(cont["args"], "--config-dir") == "/etc/baton"
    assert "BATON_API_KEY" not in env_of(cont)
    extra = args_of(renders["model-volume-values.yaml"], "router")
    assert extra[-2:] == ["--log-level", "debug"]  # extraArgs come last: they win


@pytest.mark.parametrize("role", WORKERS)
def test_worker_command(renders, role):
    cont = container(deployment(renders["defaults"], role))
    args = cont["args"]
    assert cont["command"] == ["baton"] and args[0] == "serve"
    assert flag(args, "--role") == role
    assert flag(args, "--registry") is None
    assert flag(args, "--registry-prefix") == f"{NAMESPACE}/{RELEASE}"
    assert flag(args, "--advertise-url") == "http://$(POD_IP):8000"
    assert flag(args, "--kv-host") == "$(POD_IP)"
    assert env_of(cont)["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    ports = {p["name"]: p["containerPort"] for p in cont["ports"]}
    assert ports == {"http": 8000, "kv": int(flag(args, "--kv-port"))} and ports["kv"] == 7100
    assert flag(args, "--served-model-name") == "SmolLM2-135M-Instruct"
    assert flag(args, "--model") is None and flag(args, "--max-model-len") is None
    assert [flag(args, f) for f in ("--kv-transport", "--dtype", "--block-size",
                                    "--max-num-seqs", "--max-num-batched-tokens",
                                    "--kv-cache-gib", "--drain-timeout")] == [
        "auto", "bfloat16", "16", "128", "2048", "2", "30"]
    assert flag(args, "--otlp-endpoint") is None
    env = env_of(cont)
    assert env["XDG_CACHE_HOME"]["value"] == "/cache" and env["HOME"]["value"] == "/tmp"


# -- probes and drain ------------------------------------------------------------------------
def test_probes_start_and_ready_on_ready(renders):
    for name, docs in renders.items():
        for component in COMPONENTS:
            if f"{RELEASE}-{component}" not in names(docs, "Deployment"):
                continue
            cont = container(deployment(docs, component))
            assert cont["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
            assert cont["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
        for role in WORKERS:
            if f"{RELEASE}-{role}" not in names(docs, "Deployment"):
                continue
            dep = deployment(docs, role)
            startup = container(dep)["startupProbe"]
            # /health answers while the model loads: a hung load would never be restarted.
            assert startup["httpGet"] == {"path": "/ready", "port": "http"}, name
            budget = startup["periodSeconds"] * startup["failureThreshold"]
            values = yaml.safe_load((CHART / "ci" / name).read_text()) if name != "defaults" \
                else {}
            timeout = values.get(role, {}).get("startupTimeoutSeconds", 900)
            assert timeout <= budget < timeout + startup["periodSeconds"], name
            # The rollout is not declared failed while a pod may still be loading.
            assert dep["spec"]["progressDeadlineSeconds"] > budget, name


def test_drain_grace_period_and_pre_stop(renders):
    for name, expected in (("defaults", (30, 5)), ("hf-model-values.yaml", (120, 10))):
        docs = renders[name]
        timeout, sleep = expected
        for component in COMPONENTS:
            dep = deployment(docs, component)
            pod, cont = pod_spec(dep), container(dep)
            assert cont["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", str(sleep)]}}
            # SIGTERM comes after the preStop hook; the drain must fit in the rest.
            assert pod["terminationGracePeriodSeconds"] >= sleep + timeout + 5
        for role in WORKERS:
            assert flag(args_of(docs, role), "--drain-timeout") == str(timeout)


# -- tuning-configmap.yaml ----------------------------------------------------------------
@pytest.mark.parametrize("values", ["defaults", "default-values.yaml"])
def test_tuning_configmap_is_mounted_as_a_directory(renders, values):
    docs = renders[values]
    text = find(docs, "ConfigMap", f"{RELEASE}-tuning")["data"]["baton.yaml"]
    parse_tuning(text)  # the services accept what the chart writes
    expected = {"router": {}, "worker": {}} if values == "defaults" else yaml.safe_load(
        (CHART / "ci" / values).read_text())["tuning"]
    assert yaml.safe_load(text) == expected
    for component in COMPONENTS:
        dep = deployment(docs, component)
        pod, cont = pod_spec(dep), container(dep)
        mount = {m["name"]: m for m in cont["volumeMounts"]}["tuning"]
        # subPath mounts never see kubelet's updates: live tuning needs the directory.
        assert mount == {"name": "tuning", "mountPath": "/etc/baton", "readOnly": True}
        volume = {v["name"]: v for v in pod["volumes"]}["tuning"]
        assert volume["configMap"]["name"] == f"{RELEASE}-tuning"
        assert flag(cont["args"], "--config-dir") == "/etc/baton"
        # A checksum annotation would restart the pods on every tuning change.
        assert not dep["spec"]["template"]["metadata"].get("annotations")


# -- services.yaml, pdb.yaml ----------------------------------------------------------------
def test_services_select_their_pods(renders):
    docs = renders["defaults"]
    router = find(docs, "Service", f"{RELEASE}-router")
    assert router["spec"]["type"] == "ClusterIP"
    assert router["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http",
                                        "protocol": "TCP"}]
    # Every router pod by DNS, for the planner's scrapes; not scraped by the ServiceMonitor.
    routers = find(docs, "Service", f"{RELEASE}-routers")
    assert routers["spec"]["clusterIP"] == "None" and "baton-job" not in \
        routers["metadata"]["labels"]
    for role in WORKERS:
        svc = find(docs, "Service", f"{RELEASE}-{role}")
        assert svc["spec"]["clusterIP"] == "None"
        assert [p["name"] for p in svc["spec"]["ports"]] == ["http", "kv"]
    for svc in find_all(docs, "Service"):
        component = svc["metadata"]["labels"]["app.kubernetes.io/component"]
        for other in (*COMPONENTS, "redis", "planner"):
            assert selects({"matchLabels": svc["spec"]["selector"]},
                           pod_labels(other)) == (other == component)


def test_pod_disruption_budgets(renders):
    for component in COMPONENTS:
        pdb = find(renders["defaults"], "PodDisruptionBudget", f"{RELEASE}-{component}")
        assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
        assert selects(pdb["spec"]["selector"], pod_labels(component))
    docs = renders["model-volume-values.yaml"]
    assert find(docs, "PodDisruptionBudget", f"{RELEASE}-router")["spec"] == {
        "minAvailable": "50%", "selector": {"matchLabels": pod_labels("router")}}
    assert find(docs, "PodDisruptionBudget",
                f"{RELEASE}-decode")["spec"]["maxUnavailable"] == "34%"
    assert f"{RELEASE}-prefill" not in names(docs, "PodDisruptionBudget")


# -- redis.yaml -----------------------------------------------------------------------------
def test_in_chart_redis_requires_a_password(renders):
    docs = renders["defaults"]
    dep = find(docs, "Deployment", f"{RELEASE}-redis")
    cont = container(dep)
    assert cont["image"] == "valkey/valkey:8-alpine"
    args = cont["args"]
    assert args[0] == "/conf/valkey.conf" and flag(args, "--protected-mode") == "yes"
    assert flag(args, "--save") == "" and flag(args, "--appendonly") == "no"
    (init,) = pod_spec(dep)["initContainers"]
    # The password is written into the server's config from the Secret: not in the spec.
    assert "requirepass" in init["command"][-1] and "$REDIS_PASSWORD" in init["command"][-1]
    assert env_of(init)["REDIS_PASSWORD"]["valueFrom"] == {
        "secretKeyRef": {"name": f"{RELEASE}-redis", "key": "password"}}
    conf = {v["name"]: v for v in pod_spec(dep)["volumes"]}["conf"]
    assert conf["emptyDir"]["medium"] == "Memory"
    svc = find(docs, "Service", f"{RELEASE}-redis")
    assert svc["spec"]["ports"][0]["port"] == 6379


def test_external_redis_leaves_no_in_chart_registry(renders):
    docs = renders["external-redis-values.yaml"]
    for kind in ("Deployment", "Service", "NetworkPolicy", "Secret"):
        assert f"{RELEASE}-redis" not in names(docs, kind)


# -- NOTES.txt ------------------------------------------------------------------------------
def notes(helm, *sets: str) -> str:
    cmd = [helm, "install", RELEASE, CHART, "--dry-run=client", "-n", NAMESPACE]
    for s in sets:
        cmd += ["--set", s]
    out = run(cmd)
    assert out.returncode == 0, out.stderr
    return out.stdout.split("NOTES:", 1)[1]


def test_notes_tell_how_to_reach_the_router(helm):
    text = notes(helm, "router.apiKey.value=k")
    assert f"kubectl -n {NAMESPACE} port-forward svc/{RELEASE}-router 8000:8000" in text
    assert "curl http://127.0.0.1:8000/v1/chat/completions" in text
    assert '"model": "SmolLM2-135M-Instruct"' in text
    assert "Authorization: Bearer" in text
    assert f'keys under "{NAMESPACE}/{RELEASE}"' in text


def test_notes_say_who_owns_the_pools(helm):
    text = notes(helm, "planner.enabled=true", "planner.profile=version: 1")
    assert f"{RELEASE}-prefill (scaled by the planner" in text
    assert "no `replicas` in their Deployment" in text
    text = notes(helm, "decode.autoscaling.kind=keda",
                 "decode.autoscaling.keda.serverAddress=http://p:9090")
    assert f"{RELEASE}-decode (scaled by KEDA, 1-8 pods" in text
    assert f"{RELEASE}-prefill (1 pod(s)" in text
