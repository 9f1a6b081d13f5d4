"""The router's flags (`baton router`; `baton up` passes some on to its router): the routing
policy and weights, the proxy's retries and deadlines, the disaggregation decider and peer
fetch. Defaults are read from the settings dataclasses (`field_default`)."""

from __future__ import annotations

import argparse

from baton.cli_common import field_default


def proxy_default(name: str):
    from baton.router.settings import ProxySettings

    return field_default(ProxySettings, name)


def disagg_default(name: str):
    from baton.router.settings import DisaggSettings

    return field_default(DisaggSettings, name)


def policy_flag(p) -> None:
    from baton.router.scheduling.pipeline import POLICIES
    from baton.router.settings import RouterSettings

    p.add_argument("--policy", default=field_default(RouterSettings, "policy"),
                   choices=tuple(POLICIES))


def disagg_flag(p) -> None:
    p.add_argument("--disagg-min-prefill-tokens", type=int,
                   default=disagg_default("min_prefill_tokens"),
                   help="remote prefill for prompts at least this long (estimated)")
    p.add_argument("--peer-fetch", action=argparse.BooleanOptionalAction,
                   default=disagg_default("peer_fetch"),
                   help="a decode pod pulls a prompt's prefix another pod holds instead of "
                        "prefilling it, when the cost model says that is cheaper")
    p.add_argument("--peer-fetch-min-tokens", type=int,
                   default=disagg_default("peer_fetch_min_tokens"),
                   help="peer fetch only when it saves at least this many prompt tokens")


def proxy_flags(p) -> None:
    p.add_argument("--max-attempts", type=int, default=proxy_default("max_attempts"))
    p.add_argument("--connect-timeout", type=float, default=proxy_default("connect_timeout_s"))
    p.add_argument("--first-byte-timeout", type=float,
                   default=proxy_default("first_byte_timeout_s"))
    p.add_argument("--idle-timeout", type=float, default=proxy_default("idle_timeout_s"))
    p.add_argument("--request-timeout", type=float, default=proxy_default("request_timeout_s"))


def parse_weights(text: str | None) -> dict[str, float] | None:
    """`queue=1,kv_usage=0.5` -> {"queue": 1.0, "kv_usage": 0.5}; None for no flag. Raises
    ValueError for an item that is not name=number (names are checked by the pipeline)."""
    if not text:
        return None
    weights = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        try:
            weights[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--weights: {item!r} is not name=number") from None
    return weights
