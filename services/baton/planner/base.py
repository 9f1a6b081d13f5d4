"""The planner's two outside worlds, behind small interfaces: where the live workload is read
from (`MetricsSource`) and what scales the Deployments (`KubeClient`).

Both are called from the scaler's loop thread only (`scaler.Scaler.tick`), one call at a
time; implementations need no locking. Their failures are typed (`MetricsError`,
`KubeError`) so that the loop can log them and try again at the next interval.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from baton.planner.speculation import Speculation


class MetricsError(RuntimeError):
    """The metrics page could not be read or holds no request counter."""


class KubeError(RuntimeError):
    """A Kubernetes API call failed (unreachable server, HTTP error, missing Deployment)."""


@dataclass(frozen=True)
class WorkloadEstimate:
    """The workload seen over one window between two scrapes.

    `prompt_mean` / `output_mean` are None when the page has no token counters (a plain
    router page); the planner then keeps its configured length distributions.
    """

    rate: float  # requests per second over the window
    window_s: float  # length of the window the rate was measured over
    prompt_mean: float | None = None  # prompt tokens computed per served request
    output_mean: float | None = None  # output tokens generated per served request
    source: str = "router"  # "router": baton:router_requests_total; "worker": baton:requests_total
    # what speculative decoding did on the decode pods over the window (None: the page has
    # no spec_decode counters, or no decode step ran)
    speculation: Speculation | None = None


class MetricsSource(ABC):
    """Reads the live workload."""

    @abstractmethod
    def sample(self) -> WorkloadEstimate | None:
        """Read the counters once and return the workload since the previous call.

        The first call only records a baseline and returns None (a rate needs two reads).
        Mutates only the source's own baseline. Raises `MetricsError` when the page cannot
        be fetched or parsed, or has no request counter; the baseline is then kept, so the
        next successful call measures over the longer window.
        """


class KubeClient(ABC):
    """Reads and sets the replica count of a Deployment (its `scale` subresource)."""

    @abstractmethod
    def get_replicas(self, namespace: str, name: str) -> int:
        """Return `spec.replicas` of Deployment `namespace/name`. Raises `KubeError`."""

    @abstractmethod
    def scale(self, namespace: str, name: str, replicas: int) -> None:
        """Set `spec.replicas` of Deployment `namespace/name` to `replicas` (>= 0).
        Raises `KubeError`; the Deployment is then unchanged."""
