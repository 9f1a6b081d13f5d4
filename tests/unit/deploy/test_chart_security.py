"""charts/baton's security: non-root pods (and the one opt-in way out, for RDMA), secrets
that reach the pods only as env from secretKeyRef or mounted files (never args, never NOTES),
the internal token and API keys, Redis auth, a registry prefix per release, and the
NetworkPolicies."""

from __future__ import annotations

import base64

import pytest
import yaml

from tests.unit.deploy.kube import (
    CHART,
    NAMESPACE,
    RELEASE,
    admits,
    container,
    deployment,
    env_of,
    find,
    find_all,
    helm_template,
    load_docs,
    pod_labels,
    pod_spec,
    run,
)

WORKERS = ("prefill", "decode")
COMPONENTS = ("router", *WORKERS)
RDMA = "rdma-values.yaml"


def containers(dep: dict) -> list[dict]:
    pod = pod_spec(dep)
    return pod.get("initContainers", []) + pod["containers"]


# -- non-root by default --------------------------------------------------------------------
def test_every_container_is_non_root_with_a_read_only_root(renders):
    for name, docs in renders.items():
        for dep in find_all(docs, "Deployment"):
            rdma_worker = name == RDMA and dep["metadata"]["name"].endswith(WORKERS)
            pod = pod_spec(dep)
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
            assert pod["securityContext"]["runAsNonRoot"] is not rdma_worker, name
            for cont in containers(dep):
                sc = cont.get("securityContext")
                if sc is None:  # a user's own init container (ci/model-volume-values.yaml)
                    assert cont["name"] == "wait-for-weights"
                    continue
                assert sc["readOnlyRootFilesystem"] is True
                assert sc["allowPrivilegeEscalation"] is False
                assert sc["capabilities"]["drop"] == ["ALL"]
                if rdma_worker:
                    continue
                assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 10001
                assert not sc["capabilities"].get("add"), (name, cont["name"])
            writable = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]
                        if not m.get("readOnly")}
            assert "/tmp" in writable, (name, dep["metadata"]["name"])


def test_rdma_workers_get_ipc_lock_shm_and_their_own_host_ports(renders):
    docs = renders[RDMA]
    host_ports = []
    for role in WORKERS:
        dep = deployment(docs, role)
        pod, cont = pod_spec(dep), container(dep)
        sc = cont["securityContext"]
        # Locked memory for RDMA registration: IPC_LOCK and nothing else.
        assert sc["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert sc["runAsUser"] == 0 and sc["allowPrivilegeEscalation"] is False
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert pod["runtimeClassName"] == "nvidia"
        shm = {v["name"]: v for v in pod["volumes"]}["shm"]
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
        assert {"name": "shm", "mountPath": "/dev/shm"} in cont["volumeMounts"]
        host_ports += [p["containerPort"] for p in cont["ports"]]
        assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    # One prefill and one decode pod per node can both bind their ports.
    assert len(set(host_ports)) == len(host_ports) == 4
    router = container(deployment(docs, "router"))["securityContext"]
    assert router["runAsNonRoot"] is True and not router["capabilities"].get("add")


# -- secrets: env from secretKeyRef or files, never args or NOTES ---------------------------
SECRET_SETS = ("router.apiKey.value=client-key-0123456789", "redis.enabled=false",
               "redis.external.url=rediss://:redis-password-0123@redis.x:6380/0")


def install_dry_run(helm, *sets):
    cmd = [helm, "install", RELEASE, CHART, "--dry-run=client", "-n", NAMESPACE]
    for s in sets:
        cmd += ["--set", s]
    out = run(cmd)
    assert out.returncode == 0, out.stderr
    manifest, notes = out.stdout.split("NOTES:", 1)
    return load_docs(manifest.split("MANIFEST:", 1)[1]), notes


@pytest.mark.parametrize("sets", [(), SECRET_SETS], ids=["in-chart-redis", "external-redis"])
def test_no_secret_value_in_args_env_values_or_notes(helm, sets):
    docs, notes = install_dry_run(helm, *sets)
    secrets = [base64.b64decode(v).decode() for s in find_all(docs, "Secret")
               for v in s["data"].values()]
    assert len(secrets) == (3 if sets else 2)
    if sets:
        assert "rediss://:redis-password-0123@redis.x:6380/0" in secrets
    spec_text = yaml.safe_dump([d for d in docs if d["kind"] != "Secret"])
    for value in secrets + ["redis-password-0123", "client-key-0123456789"]:
        assert value not in spec_text and value not in notes, value
    for dep in find_all(docs, "Deployment"):
        for cont in containers(dep):
            for name, env in env_of(cont).items():
                if name.endswith(("TOKEN", "KEY", "PASSWORD")) or name == "BATON_REDIS_URL":
                    assert "secretKeyRef" in env.get("valueFrom", {}) or \
                        "$(BATON_REDIS_PASSWORD)" in env.get("value", ""), (name, env)


def test_internal_token_reaches_router_and_workers_only(renders):
    for name, ref in (("defaults", {"name": f"{RELEASE}-internal", "key": "token"}),
                      ("external-redis-values.yaml",
                       {"name": "baton-internal-token", "key": "token"})):
        docs = renders[name]
        for component in COMPONENTS:
            env = env_of(container(deployment(docs, component)))
            assert env["BATON_INTERNAL_TOKEN"]["valueFrom"] == {"secretKeyRef": ref}
        assert all(s["metadata"]["name"] != f"{RELEASE}-internal"
                   for s in find_all(docs, "Secret")) == (name != "defaults")
    planner = container(find(renders["external-redis-values.yaml"], "Deployment",
                             f"{RELEASE}-planner"))
    assert not {"BATON_INTERNAL_TOKEN", "BATON_REDIS_URL"} & set(env_of(planner))
    secret = find(renders["defaults"], "Secret", f"{RELEASE}-internal")
    assert len(base64.b64decode(secret["data"]["token"])) == 48  # auth.py wants >= 16


def test_generated_secrets_differ_per_render_and_are_kept_by_lookup():
    # helm template has no cluster, so each render draws a new value; an upgrade keeps the
    # one in the cluster through `lookup` (templates/_secrets.tpl).
    text = (CHART / "templates" / "_secrets.tpl").read_text()
    assert 'lookup "v1" "Secret"' in text and "randAlphaNum" in text


def test_api_key_reaches_router_and_workers(renders):
    docs = renders["external-redis-values.yaml"]
    for component in COMPONENTS:
        env = env_of(container(deployment(docs, component)))["BATON_API_KEY"]
        assert env["valueFrom"] == {"secretKeyRef": {"name": "baton-clients", "key": "token"}}
    docs = renders["model-volume-values.yaml"]
    secret = find(docs, "Secret", f"{RELEASE}-api-key")
    assert base64.b64decode(secret["data"]["api-key"]).decode() == "not-a-real-key"
    env = env_of(container(deployment(docs, "decode")))["BATON_API_KEY"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": f"{RELEASE}-api-key", "key": "api-key"}
    assert "BATON_API_KEY" not in env_of(container(deployment(renders["defaults"], "decode")))


def test_tenant_keys_file_is_mounted_for_the_router(renders):
    docs = renders["external-redis-values.yaml"]
    dep = deployment(docs, "router")
    cont = container(dep)
    assert env_of(cont)["BATON_API_KEYS_FILE"]["value"] == "/etc/baton-keys/tenants.yaml"
    mount = {m["name"]: m for m in cont["volumeMounts"]}["api-keys"]
    assert mount == {"name": "api-keys", "mountPath": "/etc/baton-keys", "readOnly": True}
    volume = {v["name"]: v for v in pod_spec(dep)["volumes"]}["api-keys"]
    assert volume["secret"] == {"secretName": "baton-tenants",
                                "items": [{"key": "tenants.yaml", "path": "tenants.yaml"}]}
    assert "BATON_API_KEYS_FILE" not in env_of(container(deployment(renders["defaults"],
                                                                      "router")))


# -- Redis: auth, external URL, a prefix per release ------------------------------------------
def test_redis_url_comes_from_secrets(renders):
    for component in COMPONENTS:
        env = env_of(container(deployment(renders["defaults"], component)))
        assert env["BATON_REDIS_PASSWORD"]["valueFrom"] == {
            "secretKeyRef": {"name": f"{RELEASE}-redis", "key": "password"}}
        # kubelet expands $(VAR) from the env defined before it: the spec holds no password.
        assert env["BATON_REDIS_URL"]["value"] == \
            f"redis://:$(BATON_REDIS_PASSWORD)@{RELEASE}-redis:6379/0"
        names_ = list(env)
        assert names_.index("BATON_REDIS_PASSWORD") < names_.index("BATON_REDIS_URL")
        external = env_of(container(deployment(renders["external-redis-values.yaml"],
                                               component)))
        assert external["BATON_REDIS_URL"]["valueFrom"] == {
            "secretKeyRef": {"name": "registry-credentials", "key": "url"}}
        tls = env_of(container(deployment(renders["hf-model-values.yaml"], component)))
        assert tls["BATON_REDIS_URL"]["valueFrom"] == {
            "secretKeyRef": {"name": f"{RELEASE}-registry", "key": "redis-url"}}
    url = find(renders["hf-model-values.yaml"], "Secret", f"{RELEASE}-registry")
    assert base64.b64decode(url["data"]["redis-url"]).decode().startswith("rediss://")


def test_registry_prefix_is_per_release(helm):
    shared = ("redis.enabled=false", "redis.external.existingSecret=shared-redis")
    seen = {}
    for release, namespace in (("baton-a", "llm"), ("baton-b", "llm"), ("baton-a", "staging")):
        docs = helm_template(helm, sets=shared, release=release, namespace=namespace)
        prefixes = set()
        for component in COMPONENTS:
            args = container(deployment(docs, component, release=release))["args"]
            prefixes.add(args[args.index("--registry-prefix") + 1])
        (prefix,) = prefixes  # router and workers agree
        assert ":" not in prefix  # registry keys are PREFIX:worker:ID
        seen[(release, namespace)] = prefix
    assert seen == {("baton-a", "llm"): "llm/baton-a", ("baton-b", "llm"): "llm/baton-b",
                    ("baton-a", "staging"): "staging/baton-a"}
    docs = helm_template(helm, sets=("redis.prefix=team-a",))
    assert container(deployment(docs, "decode"))["args"].count("team-a") == 1


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
            for peer in COMPONENTS:
                assert admits(policies, target, pod_labels(peer), port)
            # The planner reads the routers and the API server, nothing else.
            assert not admits(policies, target, pod_labels("planner"), port)
        # KV transports open data connections beyond the handshake port between workers.
        assert admits(policies, target, pod_labels("prefill"), "ucx-data")
        assert not admits(policies, target, pod_labels("router"), "ucx-data")
    assert admits(policies, pod_labels("router"), outsider, "http", peer_namespace="x")
    for peer, allowed in ((outsider, False), (pod_labels("decode"), True),
                          (pod_labels("planner"), False)):
        assert admits(policies, pod_labels("redis"), peer, "redis") == allowed


def test_metrics_scrapers_reach_only_the_http_port(renders):
    policies = find_all(renders["external-redis-values.yaml"], "NetworkPolicy")
    scraper = {"app.kubernetes.io/name": "prometheus"}
    for role in WORKERS:
        assert admits(policies, pod_labels(role), scraper, "http", peer_namespace="monitoring")
        assert not admits(policies, pod_labels(role), scraper, "kv",
                          peer_namespace="monitoring")
        assert not admits(policies, pod_labels(role), scraper, "http", peer_namespace="other")
    assert find_all(renders["model-volume-values.yaml"], "NetworkPolicy") == []


def test_service_monitor_alone_lets_prometheus_scrape_the_workers(renders):
    """ServiceMonitor on, metricsFrom left empty: Prometheus Operator's pods get the HTTP
    port (otherwise every worker scrape fails and BatonPodDown fires for each)."""
    policies = find_all(renders["autoscaling-values.yaml"], "NetworkPolicy")
    prometheus = {"app.kubernetes.io/name": "prometheus", "prometheus": "k8s"}
    for role in WORKERS:
        for namespace in ("monitoring", NAMESPACE):
            assert admits(policies, pod_labels(role), prometheus, "http",
                          peer_namespace=namespace)
        assert not admits(policies, pod_labels(role), prometheus, "kv",
                          peer_namespace="monitoring")
        assert not admits(policies, pod_labels(role), {"app": "curl"}, "http",
                          peer_namespace="monitoring")
    # Without a ServiceMonitor nothing outside the release is let in.
    for role in WORKERS:
        assert not admits(find_all(renders["defaults"], "NetworkPolicy"), pod_labels(role),
                          prometheus, "http", peer_namespace="monitoring")
