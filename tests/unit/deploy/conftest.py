"""Session fixtures: the chart rendered once per ci/*-values.yaml (and with its defaults),
and k8s/ built once per kustomization, shared by every deploy test."""

from __future__ import annotations

import pytest

from tests.unit.deploy.kube import CI_VALUES, K8S, OVERLAYS, helm_template, kustomize, tool


@pytest.fixture(scope="session")
def helm() -> str:
    return tool("helm")


@pytest.fixture(scope="session")
def kubectl() -> str:
    return tool("kubectl")


@pytest.fixture(scope="session")
def renders(helm) -> dict[str, list[dict]]:
    """"defaults" and each ci values file's name -> the rendered documents."""
    out = {"defaults": helm_template(helm)}
    for path in CI_VALUES:
        out[path.name] = helm_template(helm, path)
    return out


@pytest.fixture(scope="session")
def builds(kubectl) -> dict[str, list[dict]]:
    """"base" and each overlay's name -> the documents `kubectl kustomize` builds."""
    out = {"base": kustomize(kubectl, K8S / "base")}
    for overlay in OVERLAYS:
        out[overlay.name] = kustomize(kubectl, overlay)
    return out
