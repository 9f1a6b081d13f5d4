"""The router's configuration: `RouterSettings` (flags, fixed for the process) and
`Tunables`, the part the tuning file changes live, as one frozen snapshot.

On a reload the router builds a new `Tunables` and swaps it in whole; each request reads
the snapshot current when it arrived and passes it to the components that need it (the
disaggregation decider, the remote prefill, the retry loop and the relay), so no
component's attributes are patched and no request sees half a reload.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from baton.common.http_limits import HEADER_TIMEOUT_S
from baton.common.tuning import RouterTuning, set_fields
from baton.router.discovery import BreakerSettings
from baton.router.scheduling.disagg import DisaggSettings
from baton.router.scheduling.pipeline import RoutingPipeline
from baton.router.tenants import TenantSpec, with_api_key

__all__ = ["DisaggSettings", "ProxySettings", "RouterSettings", "Tunables"]


@dataclass(frozen=True)
class ProxySettings:
    """Retries and deadlines of relaying a request (`router.retry`, `router.relay`)."""

    max_attempts: int = 3
    backoff_s: float = 0.05  # doubled after each failed attempt
    connect_timeout_s: float = 2.0
    first_byte_timeout_s: float = 600.0
    idle_timeout_s: float = 120.0
    request_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"ProxySettings.max_attempts={self.max_attempts} must be >= 1")
        for name in ("connect_timeout_s", "first_byte_timeout_s", "idle_timeout_s",
                     "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ProxySettings.{name} must be > 0")


@dataclass(frozen=True)
class RouterSettings:
    """The router's flags. Secrets (the API key, the tenants' keys, the internal token)
    are left out of its repr, so a logged or printed settings object shows none."""

    workers: tuple[str, ...] = ()  # static worker URLs (local mode), or
    registry_url: str | None = None  # redis://… where workers register (clusters)
    registry_prefix: str = "baton"
    # clients send `Authorization: Bearer <key>`: $BATON_API_KEY (tenant `default`) or a
    # key of a tenant of --api-keys-file (`router.tenants`); `all_tenants` has both
    api_key: str | None = field(default=None, repr=False)
    tenants: tuple[TenantSpec, ...] = field(default=(), repr=False)
    internal_token: str | None = field(default=None, repr=False)  # sent to workers
    header_timeout_s: float = HEADER_TIMEOUT_S  # a request head must arrive within this
    otlp_endpoint: str | None = None  # OTLP/HTTP traces URL (`common.tracing`); None: off
    policy: str = "load"
    scorer_weights: dict[str, float] | None = None
    check_interval_s: float = 1.0
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    proxy: ProxySettings = field(default_factory=ProxySettings)
    disagg: DisaggSettings = field(default_factory=DisaggSettings)
    config_dir: str | None = None  # a mounted tuning ConfigMap (common.tuning), live
    pinned: frozenset[str] = frozenset()  # tuning fields set by flags: the file keeps off
    # stored /v1/responses: at most this many in the process (no registry), this long in
    # the registry's Redis (`common.response_store`)
    response_store_entries: int = 1024
    response_ttl_s: int = 3600

    def __post_init__(self) -> None:
        if not self.workers and not self.registry_url:
            raise ValueError("RouterSettings: give worker URLs (workers) or a Redis "
                             "registry (registry_url)")
        if self.workers and self.registry_url:
            raise ValueError("RouterSettings: workers and registry_url exclude each other")
        if self.registry_url and not self.registry_url.startswith(
                ("redis://", "rediss://", "unix://")):
            raise ValueError(f"RouterSettings.registry_url: {self.registry_url!r} is not a "
                             "redis:// URL")
        for url in self.workers:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"RouterSettings.workers: {url!r} is not an http(s) URL")
        RoutingPipeline.from_policy(self.policy, self.scorer_weights)  # validates names
        if self.header_timeout_s <= 0:
            raise ValueError(f"RouterSettings.header_timeout_s={self.header_timeout_s} must "
                             "be > 0")
        for name in ("response_store_entries", "response_ttl_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"RouterSettings.{name}={getattr(self, name)} must be >= 1")
        self.all_tenants  # noqa: B018 - validates the API key against the tenants

    @property
    def all_tenants(self) -> tuple[TenantSpec, ...]:
        """The tenants of the keys file, and `default` for `api_key`."""
        return with_api_key(self.tenants, self.api_key)


_PROXY_TUNABLES = ("max_attempts", "first_byte_timeout_s", "idle_timeout_s",
                   "request_timeout_s")
_DISAGG_TUNABLES = {"disagg_min_prefill_tokens": "min_prefill_tokens",
                    "prefill_timeout_s": "prefill_timeout_s", "peer_fetch": "peer_fetch",
                    "peer_fetch_min_tokens": "peer_fetch_min_tokens"}  # file -> settings


@dataclass(frozen=True)
class Tunables:
    """What a request is routed and relayed with: the routing pipeline, retries and
    deadlines, and the disaggregation decider's settings."""

    pipeline: RoutingPipeline
    proxy: ProxySettings
    disagg: DisaggSettings

    @classmethod
    def of(cls, settings: RouterSettings, tuning: RouterTuning | None = None) -> Tunables:
        """The flags' values, overridden by the fields the tuning file sets and no flag
        pins (a field the file leaves out keeps the flag's value). Raises ValueError naming
        the field when the result is invalid."""
        s = settings
        t = {k: v for k, v in set_fields(tuning or RouterTuning()).items()
             if k not in s.pinned}
        return cls(
            pipeline=RoutingPipeline.from_policy(s.policy,
                                                 t.get("scorer_weights", s.scorer_weights)),
            proxy=replace(s.proxy, **{k: t[k] for k in _PROXY_TUNABLES if k in t}),
            disagg=replace(s.disagg, **{f: t[k] for k, f in _DISAGG_TUNABLES.items()
                                        if k in t}))
