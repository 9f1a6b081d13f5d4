"""What the routing plugins know about the request being routed."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RoutingContext:
    model: str | None = None
    role: str = "decode"  # the phase: "decode" (decode or colocated), "prefill", "resume"
    tried: set[str] = field(default_factory=set)  # endpoint URLs that failed this request
    # The prompt's block hashes and who holds them: the workers' own KV block hashes and
    # the registry's index (exact), or the router's estimate (router.prefix.PrefixIndex).
    prefix_hashes: list = field(default_factory=list)
    prefix_index: object | None = None  # match(url, hashes) -> leading blocks held
    block_tokens: int = 16  # tokens per block of prefix_hashes
    prompt_tokens: int | None = None  # exact count when the router tokenized the prompt
    session: str | None = None  # X-Session-Id header, else the request's `user` field
