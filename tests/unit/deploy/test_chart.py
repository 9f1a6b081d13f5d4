"""charts/baton: lint and schema, every rendered document valid for Kubernetes 1.29 and 1.37,
and what each template renders (one test per template, on the ci/ values files)."""

from __future__ import annotations

import base64
import json
import tarfile

import pytest
import yaml

from baton.common.tuning import parse_tuning
from tests.unit.deploy.kube import (BAD_VALUES, CHART, CI_VALUES, NAMESPACE, RELEASE, admits,
                                    container, env_of, find, find_all, flag, names, pod_labels,
                                    run, selects, validation_problems)

WORKERS = ("prefill", "decode")
COMPONENTS = ("router", *WORKERS)


def deployment(docs, component):
    return find(docs, "Deployment", f"{RELEASE}-{component}")


def args_of(docs, component):
    return container(deployment(docs, component))["args"]


# -- lint, schema, validity -------------------------------------------------------------
@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name)
def test_lint_strict_passes(helm, values):
    out = run([helm, "lint", "--strict", CHART, "-f", values])
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_rendered_document_validates(renders):
    assert set(renders) == {"defaults", *(p.name for p in CI_VALUES)}
    for name, docs in renders.items():
        assert docs, name
        assert validation_problems(docs) == [], name


# The schema error must name the offending field, not just say "invalid".
BAD_FIELDS = {"replicas-string-values.yaml": "/prefill/replicas",
              "unknown-key-values.yaml": "kvTransprot"}


@pytest.mark.parametrize("values", BAD_VALUES, ids=lambda p: p.name)
def test_bad_values_fail_lint_and_template(helm, values):
    field = BAD_FIELDS[values.name]
    lint = run([helm, "lint", "--strict", CHART, "-f", values])
    assert lint.returncode != 0 and field in lint.stdout + lint.stderr
    template = run([helm, "template", RELEASE, CHART, "-f", values])
    assert template.returncode != 0 and field in template.stderr


def test_conflicting_values_are_refused(helm):
    for sets, message in (
            (["router.apiKey.existingSecret=a", "router.apiKey.value=b"], "router.apiKey"),
            (["model.volume.claimName=a", "model.volume.hostPath=/b"], "model.volume"),
            (["redis.enabled=false"], "redis.external.url"),
            (["decode.hostNetwork=true"], "decode.hostNetwork"),
            (["planner.enabled=true"], "planner.profile")):
        cmd = [helm, "template", RELEASE, CHART]
        for s in sets:
            cmd += ["--set", s]
        out = run(cmd)
        assert out.returncode != 0 and message in out.stderr
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


# -- pods (router-deployment.yaml, worker-deployment.yaml, redis.yaml, planner.yaml) -------
def test_every_container_is_non_root_with_a_read_only_root(renders):
    for name, docs in renders.items():
        for dep in find_all(docs, "Deployment"):
            pod = dep["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True, name
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
            for cont in pod["containers"]:
                sc = cont["securityContext"]
                assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 10001
                assert sc["readOnlyRootFilesystem"] is True
                assert sc["allowPrivilegeEscalation"] is False
                assert sc["capabilities"]["drop"] == ["ALL"]
                writable = {m["mountPath"] for m in cont["volumeMounts"]
                            if not m.get("readOnly")}
                assert "/tmp" in writable, (name, cont["name"])


def test_router_command(renders):
    docs = renders["defaults"]
    cont = container(deployment(docs, "router"))
    assert cont["command"] == ["baton"] and cont["args"][0] == "router"
    assert flag(cont["args"], "--registry") == f"redis://{RELEASE}-redis:6379/0"
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
    assert flag(args, "--registry") == f"redis://{RELEASE}-redis:6379/0"
    assert flag(args, "--advertise-url") == "http://$(POD_IP):8000"
    assert flag(args, "--kv-host") == "$(POD_IP)"
    assert env_of(cont)["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    ports = {p["name"]: p["containerPort"] for p in cont["ports"]}
    assert ports == {"http": 8000, "kv": int(flag(args, "--kv-port"))} and ports["kv"] == 7100
    assert flag(args, "--served-model-name") == "SmolLM2-135M-Instruct"
    assert flag(args, "--model") is None and flag(args, "--max-model-len") is None
    assert [flag(args, f) for f in ("--kv-transport", "--dtype", "--block-size",
                                    "--max-num-seqs", "--max-num-batched-tokens",
                                    "--kv-cache-gib")] == ["auto", "bfloat16", "16", "128",
                                                           "2048", "2"]
    env = env_of(cont)
    assert env["XDG_CACHE_HOME"]["value"] == "/cache" and env["HOME"]["value"] == "/tmp"


def test_probes(renders):
    docs = renders["defaults"]
    for component in COMPONENTS:
        cont = container(deployment(docs, component))
        assert cont["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert cont["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    for role in WORKERS:
        startup = container(deployment(docs, role))["startupProbe"]
        assert startup["httpGet"]["path"] == "/health"
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 900


def test_gpu_values_request_gpus_rdma_and_nixl(renders):
    docs = renders["gpu-values.yaml"]
    for role in WORKERS:
        dep = deployment(docs, role)
        pod, cont = dep["spec"]["template"]["spec"], container(dep)
        assert cont["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert cont["resources"]["limits"]["rdma/ib"] == 1
        assert flag(cont["args"], "--kv-transport") == "nixl"
        assert cont["image"] == "baton:0.1.0-cuda"
        assert {"key": "nvidia.com/gpu", "operator": "Exists",
                "effect": "NoSchedule"} in pod["tolerations"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert not pod.get("hostNetwork") and pod["hostIPC"] is True
        # Weights from the PVC, read-only, and --model pointing into it.
        assert flag(cont["args"], "--model") == "/models/Llama-3.1-8B-Instruct"
        assert flag(cont["args"], "--max-model-len") == "8192"
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "model-weights",
                                                             "readOnly": True}
        mount = {m["name"]: m for m in cont["volumeMounts"]}["model"]
        assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}
    router = container(deployment(docs, "router"))
    assert "nvidia.com/gpu" not in router["resources"].get("limits", {})


def test_model_from_a_host_path(renders):
    docs = renders["model-volume-values.yaml"]
    pod = deployment(docs, "decode")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"]["hostPath"] == {"path": "/var/lib/models", "type": "Directory"}
    assert flag(container(deployment(docs, "decode"))["args"], "--model") == "/weights/tiny"
    assert pod["serviceAccountName"] == "existing-sa"
    assert "ServiceAccount" not in {d["kind"] for d in docs}
    assert f"{RELEASE}-prefill" not in names(docs, "Deployment")  # prefill disabled


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
        pod, cont = dep["spec"]["template"]["spec"], container(dep)
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
def test_in_chart_redis(renders):
    docs = renders["defaults"]
    cont = container(find(docs, "Deployment", f"{RELEASE}-redis"))
    assert cont["image"] == "valkey/valkey:8-alpine"
    assert flag(cont["args"], "--save") == "" and flag(cont["args"], "--appendonly") == "no"
    svc = find(docs, "Service", f"{RELEASE}-redis")
    assert svc["spec"]["ports"][0]["port"] == 6379


def test_external_redis(renders):
    docs = renders["external-redis-values.yaml"]
    url = "redis://my-redis.cache.svc:6379/0"
    for component in COMPONENTS:
        assert flag(args_of(docs, component), "--registry") == url
    for kind in ("Deployment", "Service", "NetworkPolicy"):
        assert f"{RELEASE}-redis" not in names(docs, kind)


# -- networkpolicy.yaml ---------------------------------------------------------------------
def test_worker_ports_only_reachable_from_the_release(renders):
    policies = find_all(renders["defaults"], "NetworkPolicy")
    outsider, other_release = {"app": "curl"}, pod_labels("router", release="other")
    for role in WORKERS:
        target = pod_labels(role)
        for port in ("http", "kv"):  # /internal/* lives on http
            assert not admits(policies, target, outsider, port)
            assert not admits(policies, target, other_release, port)
            assert not admits(policies, target, outsider, port, peer_namespace="monitoring")
            for peer in (*COMPONENTS, "planner"):
                assert admits(policies, target, pod_labels(peer), port)
        # KV transports open data connections beyond the handshake port between workers.
        assert admits(policies, target, pod_labels("prefill"), "ucx-data")
        assert not admits(policies, target, pod_labels("router"), "ucx-data")
    assert admits(policies, pod_labels("router"), outsider, "http", peer_namespace="x")
    for peer, allowed in ((outsider, False), (pod_labels("decode"), True)):
        assert admits(policies, pod_labels("redis"), peer, "redis") == allowed


def test_metrics_scrapers_reach_only_the_http_port(renders):
    policies = find_all(renders["external-redis-values.yaml"], "NetworkPolicy")
    scraper = {"app.kubernetes.io/name": "prometheus"}
    for role in WORKERS:
        assert admits(policies, pod_labels(role), scraper, "http", peer_namespace="monitoring")
        assert not admits(policies, pod_labels(role), scraper, "kv",
                          peer_namespace="monitoring")
    assert find_all(renders["model-volume-values.yaml"], "NetworkPolicy") == []


# -- api-key-secret.yaml --------------------------------------------------------------------
def test_api_key_from_an_existing_secret(renders):
    docs = renders["external-redis-values.yaml"]
    env = env_of(container(deployment(docs, "router")))["BATON_API_KEY"]
    assert env["valueFrom"] == {"secretKeyRef": {"name": "baton-clients", "key": "token"}}
    assert find_all(docs, "Secret") == []


def test_api_key_in_a_secret_the_chart_creates(renders):
    docs = renders["model-volume-values.yaml"]
    secret = find(docs, "Secret", f"{RELEASE}-api-key")
    assert base64.b64decode(secret["data"]["api-key"]).decode() == "not-a-real-key"
    env = env_of(container(deployment(docs, "router")))["BATON_API_KEY"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": f"{RELEASE}-api-key", "key": "api-key"}
    # Workers are behind the NetworkPolicy, not the key.
    assert "BATON_API_KEY" not in env_of(container(deployment(docs, "decode")))


# -- planner.yaml ---------------------------------------------------------------------------
def test_planner_rbac_and_command(renders):
    docs = renders["external-redis-values.yaml"]
    name = f"{RELEASE}-planner"
    rules = find(docs, "Role", name)["rules"]
    grants = {(res, verb) for r in rules if r["apiGroups"] == ["apps"]
              for res in r["resources"] for verb in r["verbs"]}
    assert {("deployments/scale", "patch"), ("deployments/scale", "update"),
            ("deployments", "get"), ("deployments", "list"), ("deployments", "watch")} <= grants
    assert not any(res == "deployments" and verb in ("patch", "update", "delete")
                   for res, verb in grants)
    binding = find(docs, "RoleBinding", name)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": name}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name,
                                    "namespace": NAMESPACE}]
    dep = find(docs, "Deployment", name)
    pod, cont = dep["spec"]["template"]["spec"], container(dep)
    assert pod["serviceAccountName"] == name and pod["automountServiceAccountToken"] is True
    args = cont["args"]
    assert args[0] == "planner" and flag(args, "--namespace") == "$(POD_NAMESPACE)"
    assert env_of(cont)["POD_NAMESPACE"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.namespace"}}
    assert flag(args, "--prefill-deployment") == f"{RELEASE}-prefill"
    assert flag(args, "--decode-deployment") == f"{RELEASE}-decode"
    assert flag(args, "--metrics-url") == f"http://{RELEASE}-router:8000/metrics"
    assert flag(args, "--profile") == "/etc/baton-planner/profile.yaml"
    assert [flag(args, f) for f in ("--interval", "--ttft-slo", "--itl-slo", "--min-prefill",
                                    "--max-prefill", "--min-decode", "--max-decode")] == [
        "60", "0.5", "0.04", "1", "4", "1", "12"]
    profile = find(docs, "ConfigMap", name)["data"]["profile.yaml"]
    values = yaml.safe_load((CHART / "ci" / "external-redis-values.yaml").read_text())
    assert profile == values["planner"]["profile"]  # verbatim
    from baton.planner.profile import Profile  # the planner reads what the chart mounts

    assert Profile.from_dict(yaml.safe_load(profile)).prefill.b == 2e-05
    mount = {m["name"]: m for m in cont["volumeMounts"]}["profile"]
    assert mount["mountPath"] == "/etc/baton-planner"
    # Only the planner talks to the Kubernetes API.
    for component in COMPONENTS:
        assert deployment(docs, component)["spec"]["template"]["spec"][
            "automountServiceAccountToken"] is False
    assert name not in names(renders["defaults"], "Deployment")


# -- servicemonitor.yaml, prometheusrule.yaml, dashboard-configmap.yaml --------------------
def test_service_monitor_scrapes_the_three_services(renders):
    docs = renders["external-redis-values.yaml"]
    (monitor,) = find_all(docs, "ServiceMonitor")
    spec = monitor["spec"]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert spec["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s"}]
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    selected = {s["metadata"]["name"] for s in find_all(docs, "Service")
                if selects(spec["selector"], s["metadata"]["labels"])}
    assert selected == {f"{RELEASE}-{c}" for c in COMPONENTS}
    # The alerts select job=~"baton.*": the job label comes from the Services' jobLabel.
    for svc in find_all(docs, "Service"):
        assert svc["metadata"]["labels"][spec["jobLabel"]].startswith("baton-")
    assert find_all(renders["defaults"], "ServiceMonitor") == []


def test_prometheus_rule_wraps_the_alert_file(renders):
    (rule,) = find_all(renders["external-redis-values.yaml"], "PrometheusRule")
    alerts = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]
    assert find_all(renders["defaults"], "PrometheusRule") == []


def test_dashboard_configmap_holds_the_dashboard(renders):
    docs = renders["external-redis-values.yaml"]
    cm = find(docs, "ConfigMap", f"{RELEASE}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    shipped = json.loads((CHART / "files" / "dashboard.json").read_text())
    assert json.loads(cm["data"]["baton.json"]) == shipped
    assert f"{RELEASE}-dashboard" not in names(renders["defaults"], "ConfigMap")


# -- NOTES.txt ------------------------------------------------------------------------------
def test_notes_tell_how_to_reach_the_router(helm):
    out = run([helm, "install", RELEASE, CHART, "--dry-run=client", "-n", NAMESPACE,
               "--set", "router.apiKey.value=k"])
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    assert f"kubectl -n {NAMESPACE} port-forward svc/{RELEASE}-router 8000:8000" in notes
    assert "curl http://127.0.0.1:8000/v1/chat/completions" in notes
    assert '"model": "SmolLM2-135M-Instruct"' in notes
    assert "Authorization: Bearer" in notes
