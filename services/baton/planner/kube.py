"""`KubernetesClient`: Deployment replicas through the official `kubernetes` client.

It reads and patches the Deployment's `scale` subresource (what `kubectl scale` does), so
the planner's Role needs only `get` and `patch` on `deployments/scale`. The client library
is imported here, when a client is built, so that nothing else in Baton needs it installed.

Where the API server is: `api_url` when given (tests against an emulator, or a proxy such as
`kubectl proxy`), else the in-cluster service account, else the local kubeconfig.
"""

from __future__ import annotations

from typing import Any

from baton.planner.base import KubeClient, KubeError


def _kubernetes():
    try:
        import kubernetes
    except ImportError:
        raise KubeError("the planner needs the Kubernetes client library: "
                        "pip install kubernetes==37.0.2") from None
    return kubernetes


class KubernetesClient(KubeClient):
    def __init__(self, api_url: str | None = None, timeout_s: float = 10.0) -> None:
        k8s = _kubernetes()
        self._errors = _error_types(k8s)
        self._apps = k8s.client.AppsV1Api(_api_client(k8s, api_url))
        self.timeout_s = timeout_s

    def get_replicas(self, namespace: str, name: str) -> int:
        scale = self._call("read", namespace, name, lambda: (
            self._apps.read_namespaced_deployment_scale(
                name, namespace, _request_timeout=self.timeout_s)))
        return int(scale.spec.replicas or 0) if scale.spec is not None else 0

    def scale(self, namespace: str, name: str, replicas: int) -> None:
        if replicas < 0:
            raise ValueError(f"replicas={replicas} must be >= 0")
        body = {"spec": {"replicas": int(replicas)}}
        self._call("scale", namespace, name, lambda: (
            self._apps.patch_namespaced_deployment_scale(
                name, namespace, body, _request_timeout=self.timeout_s)))

    def _call(self, what: str, namespace: str, name: str, fn):
        api_error, transport_errors = self._errors
        where = f"{what} deployments/{name}/scale in namespace {namespace!r}"
        try:
            return fn()
        except api_error as err:
            raise KubeError(f"{where}: HTTP {err.status} {err.reason}"
                            + (" (does the Deployment exist?)" if err.status == 404 else "")
                            ) from None
        except transport_errors as err:
            raise KubeError(f"{where}: {type(err).__name__}: {err}") from None


def _error_types(k8s) -> tuple[type[Any], tuple[type[BaseException], ...]]:
    """The client's ApiException (untyped: it has `status` and `reason`), and the transport
    errors."""
    import urllib3

    return k8s.client.ApiException, (urllib3.exceptions.HTTPError, OSError, ValueError)


def _api_client(k8s, api_url: str | None):
    """An ApiClient with its own Configuration (the library's global default is left alone)."""
    cfg = k8s.client.Configuration()
    if api_url is not None:
        cfg.host = api_url.rstrip("/")
        return k8s.client.ApiClient(cfg)
    try:
        k8s.config.load_incluster_config(client_configuration=cfg)
    except k8s.config.ConfigException:
        try:
            k8s.config.load_kube_config(client_configuration=cfg)
        except (k8s.config.ConfigException, OSError) as err:
            raise KubeError("no Kubernetes API found: not running in a cluster and no usable "
                            f"kubeconfig ({err}); pass --kube-api URL") from None
    return k8s.client.ApiClient(cfg)
