"""Small builders for the planner tests: a synthetic profile with known costs, workloads,
and the fakes behind the planner's two interfaces (Kubernetes and metrics)."""

from __future__ import annotations

from baton.planner.base import KubeClient, KubeError, MetricsError, MetricsSource, WorkloadEstimate
from baton.planner.profile import DecodeCost, EngineLimits, Hardware, PrefillCost, Profile
from baton.planner.simulate import LengthDist, Workload


def make_profile(a: float = 0.01, b: float = 2e-4, c: float = 0.01, d: float = 5e-4,
                 e: float = 2e-7, max_num_seqs: int = 128, chunk: int = 2048,
                 max_model_len: int = 8192) -> Profile:
    """Costs of roughly a small model on one GPU: 0.1 s to prefill 500 tokens, ~11 ms per
    decode step at batch 1 and ~75 ms at batch 128."""
    return Profile(model="synthetic", dtype="bfloat16",
                   hardware=Hardware("cpu", "test cpu", None, "0", 1),
                   limits=EngineLimits(chunk, max_num_seqs, max_model_len),
                   prefill=PrefillCost(a, b), decode=DecodeCost(c, d, e))


def make_workload(rate: float, prompt: float = 512, output: float = 128, sigma: float = 0.8,
                  num_requests: int = 2000, seed: int = 0) -> Workload:
    return Workload(rate, LengthDist(prompt, sigma, 4096, "prompt"),
                    LengthDist(output, sigma, 1024, "output"), num_requests, seed)


class FakeKube(KubeClient):
    """Deployments as a dict; `failures["read"]` / `failures["scale"]` make that many of the
    next such calls raise KubeError."""

    def __init__(self, replicas: dict[str, int]) -> None:
        self.replicas = dict(replicas)
        self.scale_calls: list[tuple[str, int]] = []
        self.failures = {"read": 0, "scale": 0}

    def _maybe_fail(self, op: str, name: str) -> None:
        if self.failures[op] > 0:
            self.failures[op] -= 1
            raise KubeError(f"{op} {name}: HTTP 503 Service Unavailable")

    def get_replicas(self, namespace: str, name: str) -> int:
        self._maybe_fail("read", name)
        if name not in self.replicas:
            raise KubeError(f"read {name}: HTTP 404 Not Found")
        return self.replicas[name]

    def scale(self, namespace: str, name: str, replicas: int) -> None:
        self._maybe_fail("scale", name)
        self.scale_calls.append((name, replicas))
        self.replicas[name] = replicas


class FakeMetrics(MetricsSource):
    """Returns the queued estimates in order; an exception in the queue is raised instead."""

    def __init__(self, *items: WorkloadEstimate | MetricsError | None) -> None:
        self.items = list(items)

    def sample(self) -> WorkloadEstimate | None:
        item = self.items.pop(0)
        if isinstance(item, MetricsError):
            raise item
        return item


def rate(r: float, prompt: float | None = None, output: float | None = None
         ) -> WorkloadEstimate:
    return WorkloadEstimate(rate=r, window_s=30.0, prompt_mean=prompt, output_mean=output)
