"""charts/baton's scaling: who owns a pool's replicas (Helm, the planner, KEDA or an HPA,
never two), the planner's least-privilege RBAC, command, metrics over every router pod and
checksum restart, and the autoscaler objects."""

from __future__ import annotations

import yaml

from tests.unit.deploy.kube import (
    CHART,
    NAMESPACE,
    RELEASE,
    container,
    deployment,
    env_of,
    find,
    find_all,
    flag,
    helm_template,
    names,
    pod_spec,
    selects,
)

WORKERS = ("prefill", "decode")
PLANNER = "external-redis-values.yaml"
AUTOSCALING = "autoscaling-values.yaml"


# -- who owns replicas ------------------------------------------------------------------------
def test_helm_sets_replicas_only_for_pools_nobody_else_scales(renders):
    for name, docs in renders.items():
        values = {} if name == "defaults" else yaml.safe_load((CHART / "ci" / name).read_text())
        planner = values.get("planner", {}).get("enabled", False)
        for role in WORKERS:
            if f"{RELEASE}-{role}" not in names(docs, "Deployment"):
                continue
            owned = planner or bool(values.get(role, {}).get("autoscaling", {}).get("kind"))
            spec = deployment(docs, role)["spec"]
            # An owner besides Helm: no replicas, or every upgrade would fight it.
            assert ("replicas" in spec) is not owned, (name, role)
        assert "replicas" in deployment(docs, "router")["spec"]
    assert deployment(renders["gpu-values.yaml"], "decode")["spec"]["replicas"] == 4


def test_planner_owns_both_pools(renders):
    docs = renders[PLANNER]
    for role in WORKERS:
        assert "replicas" not in deployment(docs, role)["spec"]
    assert find_all(docs, "ScaledObject") == find_all(docs, "HorizontalPodAutoscaler") == []


# -- planner.yaml ---------------------------------------------------------------------------
def test_planner_rbac_is_least_privilege(renders):
    docs = renders[PLANNER]
    name = f"{RELEASE}-planner"
    (rule,) = find(docs, "Role", name)["rules"]
    # get/patch on the two Deployments' scale subresource: what kube.py calls, nothing more.
    assert rule == {"apiGroups": ["apps"], "resources": ["deployments/scale"],
                    "resourceNames": [f"{RELEASE}-prefill", f"{RELEASE}-decode"],
                    "verbs": ["get", "patch"]}
    assert find_all(docs, "ClusterRole") == find_all(docs, "ClusterRoleBinding") == []
    binding = find(docs, "RoleBinding", name)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": name}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name,
                                    "namespace": NAMESPACE}]
    # Only the planner talks to the Kubernetes API.
    for dep in find_all(docs, "Deployment"):
        assert pod_spec(dep)["automountServiceAccountToken"] is (dep["metadata"]["name"] == name)


def test_planner_command_reads_every_router_pod(renders):
    docs = renders[PLANNER]
    dep = find(docs, "Deployment", f"{RELEASE}-planner")
    pod, cont = pod_spec(dep), container(dep)
    assert pod["serviceAccountName"] == f"{RELEASE}-planner"
    assert dep["spec"]["strategy"] == {"type": "Recreate"}  # never two planners at once
    args = cont["args"]
    assert args[0] == "planner" and flag(args, "--namespace") == "$(POD_NAMESPACE)"
    assert env_of(cont)["POD_NAMESPACE"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.namespace"}}
    assert flag(args, "--prefill-deployment") == f"{RELEASE}-prefill"
    assert flag(args, "--decode-deployment") == f"{RELEASE}-decode"
    # The headless Service: DNS answers every router pod (two here), each scraped alone.
    url = flag(args, "--metrics-url")
    assert url == f"http://{RELEASE}-routers:8000/metrics"
    headless = find(docs, "Service", f"{RELEASE}-routers")
    assert headless["spec"]["clusterIP"] == "None"
    router_pod = deployment(docs, "router")["spec"]["template"]["metadata"]["labels"]
    assert selects({"matchLabels": headless["spec"]["selector"]}, router_pod)
    assert deployment(docs, "router")["spec"]["replicas"] == 2
    assert flag(args, "--profile") == "/etc/baton-planner/profile.yaml"
    assert [flag(args, f) for f in ("--interval", "--ttft-slo", "--itl-slo", "--min-prefill",
                                    "--max-prefill", "--min-decode", "--max-decode")] == [
        "60", "0.5", "0.04", "1", "4", "1", "12"]
    assert cont["image"] == "baton:0.1.0"


def test_planner_profile_is_verbatim_and_restarts_the_planner(helm, renders):
    docs = renders[PLANNER]
    name = f"{RELEASE}-planner"
    profile = find(docs, "ConfigMap", name)["data"]["profile.yaml"]
    values = yaml.safe_load((CHART / "ci" / PLANNER).read_text())
    assert profile == values["planner"]["profile"]  # verbatim
    from baton.planner.profile import Profile  # the planner reads what the chart mounts

    assert Profile.from_dict(yaml.safe_load(profile)).prefill.b == 2e-05
    mount = {m["name"]: m for m in container(find(docs, "Deployment", name))["volumeMounts"]}
    assert mount["profile"]["mountPath"] == "/etc/baton-planner"

    def checksum(profile_text):
        out = helm_template(helm, CHART / "ci" / PLANNER,
                            sets=(f"planner.profile={profile_text}",))
        dep = find(out, "Deployment", name)
        return dep["spec"]["template"]["metadata"]["annotations"]["checksum/profile"]

    assert checksum("version: 1") != checksum("version: 2")
    assert checksum("version: 1") == checksum("version: 1")
    assert name not in names(renders["defaults"], "Deployment")


# -- autoscaling.yaml -------------------------------------------------------------------------
def test_keda_scales_prefill_on_the_routers_remote_prefill_rate(renders):
    docs = renders[AUTOSCALING]
    assert "replicas" not in deployment(docs, "prefill")["spec"]
    (scaled,) = find_all(docs, "ScaledObject")
    spec = scaled["spec"]
    assert scaled["metadata"]["name"] == f"{RELEASE}-prefill"
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                      "name": f"{RELEASE}-prefill"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 6)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    meta = trigger["metadata"]
    assert meta["serverAddress"] == "http://prometheus-operated.monitoring.svc:9090"
    assert meta["threshold"] == "3"
    # This release's routers only: another release's traffic must not scale this pool.
    assert meta["query"] == ('sum(rate(baton:disagg_decisions_total{namespace="llm", '
                             'baton_release="baton", decision="remote"}[2m]))')


def test_hpa_scales_decode_on_an_external_metric(renders):
    docs = renders[AUTOSCALING]
    assert "replicas" not in deployment(docs, "decode")["spec"]
    (hpa,) = find_all(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    spec = hpa["spec"]
    assert spec["scaleTargetRef"]["name"] == f"{RELEASE}-decode"
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 16)
    (metric,) = spec["metrics"]
    assert metric == {"type": "External", "external": {
        "metric": {"name": "baton_router_requests_per_second",
                   "selector": {"matchLabels": {"baton_release": RELEASE}}},
        "target": {"type": "AverageValue", "averageValue": "5"}}}


def test_default_decode_query_and_custom_queries(helm):
    docs = helm_template(helm, sets=("decode.autoscaling.kind=keda",
                                     "decode.autoscaling.keda.serverAddress=http://p:9090"))
    (scaled,) = find_all(docs, "ScaledObject")
    query = scaled["spec"]["triggers"][0]["metadata"]["query"]
    assert query == 'sum(rate(baton:router_requests_total{namespace="llm", ' \
                    'baton_release="baton"}[2m]))'
    docs = helm_template(helm, sets=("decode.autoscaling.kind=keda",
                                     "decode.autoscaling.keda.serverAddress=http://p:9090",
                                     "decode.autoscaling.keda.query=sum(up)"))
    assert find_all(docs, "ScaledObject")[0]["spec"]["triggers"][0]["metadata"]["query"] == \
        "sum(up)"
