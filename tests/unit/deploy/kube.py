"""Helpers for the chart and manifest tests: find helm and kubectl, render, validate every
document against the Kubernetes schemas, and evaluate NetworkPolicies and label selectors."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.unit.deploy import crds

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "baton"
K8S = ROOT / "k8s"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
BAD_VALUES = sorted((CHART / "ci-bad").glob("*-values.yaml"))
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schemas.
KUBE_VERSIONS = ("1.29", "1.37")
RELEASE, NAMESPACE = "baton", "llm"
HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")


def tool(name: str) -> str:
    """helm or kubectl from the venv (make k8s-tools) or PATH; skip when missing, unless
    BATON_REQUIRE_HELM=1 (CI), where a missing tool fails."""
    local = ROOT / ".venv" / "bin" / name
    found = str(local) if os.access(local, os.X_OK) else shutil.which(name)
    if found is None:
        message = f"{name} is not installed (run `make k8s-tools`)"
        if os.environ.get("BATON_REQUIRE_HELM") == "1":
            pytest.fail(f"{message}; BATON_REQUIRE_HELM=1 requires it")
        pytest.skip(message)
    return found


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120)


def load_docs(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def helm_template(helm: str, *values: Path, sets: tuple[str, ...] = (), release: str = RELEASE,
                  namespace: str = NAMESPACE) -> list[dict]:
    cmd = [helm, "template", release, CHART, "--namespace", namespace]
    for path in values:
        cmd += ["-f", path]
    for assignment in sets:
        cmd += ["--set", assignment]
    out = run(cmd)
    assert out.returncode == 0, out.stderr
    return load_docs(out.stdout)


def kustomize(kubectl: str, directory: Path) -> list[dict]:
    out = run([kubectl, "kustomize", directory])
    assert out.returncode == 0, out.stderr
    return load_docs(out.stdout)


def validation_problems(docs: list[dict]) -> list[str]:
    """Every document against the strict (no unknown field) schemas of each version, or a
    custom resource against its CRD's vendored schema (crds.py); a kind with neither is a
    problem."""
    problems = []
    for doc in docs:
        what = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        if crds.has_schema(doc):
            problems += crds.crd_problems(doc)
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                path = ".".join(str(p) for p in err.path)
                problems.append(f"{what} on {version}: {path}: {err.message}")
            except kubernetes_validate.SchemaNotFoundError as err:
                problems.append(f"{what}: {err.message}")
    return problems


# -- Finding objects ----------------------------------------------------------------------
def find_all(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def find(docs: list[dict], kind: str, name: str) -> dict:
    matches = [d for d in find_all(docs, kind) if d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def names(docs: list[dict], kind: str) -> set[str]:
    return {d["metadata"]["name"] for d in find_all(docs, kind)}


def deployment(docs: list[dict], component: str, release: str = RELEASE) -> dict:
    return find(docs, "Deployment", f"{release}-{component}")


def pod_spec(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def flag(args: list[str], name: str) -> str | None:
    """The value after `name` in an argument list (None when absent; fails if repeated)."""
    assert args.count(name) <= 1, f"{name} given {args.count(name)} times: {args}"
    return args[args.index(name) + 1] if name in args else None


def env_of(cont: dict) -> dict[str, dict]:
    return {e["name"]: e for e in cont.get("env", [])}


def strip_helm_labels(obj):
    if isinstance(obj, dict):
        return {k: strip_helm_labels(v) for k, v in obj.items() if k not in HELM_LABELS}
    if isinstance(obj, list):
        return [strip_helm_labels(v) for v in obj]
    return obj


# -- Label selectors and NetworkPolicies --------------------------------------------------
def selects(selector: dict, labels: dict) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": labels.get(key) in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def pod_labels(component: str, release: str = RELEASE) -> dict:
    return {"app.kubernetes.io/name": "baton", "app.kubernetes.io/instance": release,
            "app.kubernetes.io/component": component}


def admits(policies: list[dict], target: dict, peer: dict, port: str,
           peer_namespace: str = NAMESPACE) -> bool:
    """Whether ingress from a pod (labels `peer`) in `peer_namespace` to a pod (labels
    `target`) on the named port is allowed: no policy selecting the target = open."""
    ns_labels = {"kubernetes.io/metadata.name": peer_namespace}
    selecting = [p for p in policies if selects(p["spec"]["podSelector"], target)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(p.get("port") == port for p in ports):
                continue
            for source in rule.get("from") or [{}]:
                if not source or "ipBlock" in source:
                    return True  # no `from`: every source; an ipBlock may hold any pod
                ns_sel = source.get("namespaceSelector")
                if ns_sel is None and peer_namespace != NAMESPACE:
                    continue
                if ns_sel is not None and not selects(ns_sel, ns_labels):
                    continue
                if selects(source.get("podSelector", {}), peer):
                    return True
    return False
