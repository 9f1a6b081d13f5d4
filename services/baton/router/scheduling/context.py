"""What the routing plugins know about the request being routed."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RoutingContext:
    model: str | None = None
    role: str = "decode"  # the phase: "decode" (decode or colocated), "prefill", "resume"
    tried: set[str] = field(default_factory=set)  # endpoint URLs that failed this request
    prefix_hashes: list[int] = field(default_factory=list)  # the prompt's block hashes
    prefix_index: object | None = None  # a router.prefix.PrefixIndex
