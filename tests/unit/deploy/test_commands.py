"""Every container command the chart and the manifests render is one `baton` accepts: the
flags parse with the real command-line parser (so a renamed or removed flag fails here,
not in a crash-looping pod), and the settings they build are valid. The registry URL is not
an argument: router and workers read it from $BATON_REDIS_URL (a Secret), set here as the
pod's env would set it."""

from __future__ import annotations

import pytest

from baton.cli import build_parser
from tests.unit.deploy.kube import find_all

POD_ENV = {"$(POD_IP)": "10.1.2.3", "$(POD_NAMESPACE)": "baton"}


def expand(arg: str) -> str:
    """What kubelet makes of `$(VAR)` references to the pod's env."""
    for ref, value in POD_ENV.items():
        arg = arg.replace(ref, value)
    return arg


def baton_commands(docs: list[dict]) -> list[list[str]]:
    out = []
    for d in find_all(docs, "Deployment"):
        for c in d["spec"]["template"]["spec"]["containers"]:
            if c.get("command", ["baton"])[0] == "baton" and "redis" not in c["image"] and \
                    "valkey" not in c["image"]:
                out.append([expand(a) for a in c.get("args", [])])
    return out


REDIS_URL = "redis://:pw@baton-redis:6379/0"  # what $(BATON_REDIS_PASSWORD) expands into


def check(args: list[str]) -> None:
    parsed = build_parser().parse_args(args)
    if parsed.command in ("serve", "router"):
        assert parsed.registry == REDIS_URL  # from the env, not from an argument
    if parsed.command == "serve":
        from baton.cli_common import engine_config

        assert parsed.advertise_url.startswith("http://10.1.2.3:")
        assert parsed.kv_host == "10.1.2.3" and parsed.kv_port > 0
        engine_config(parsed)  # raises ValueError naming a bad field
    elif parsed.command == "router":
        from baton.cli import _router_settings

        _router_settings(parsed)  # raises ValueError naming a bad flag or field


@pytest.mark.parametrize("source", ["renders", "builds"])
def test_rendered_commands_parse(source, request, monkeypatch):
    monkeypatch.setenv("BATON_REDIS_URL", REDIS_URL)
    docs_by_name = request.getfixturevalue(source)
    seen = set()
    for name, docs in docs_by_name.items():
        for args in baton_commands(docs):
            try:
                check(args)
            except SystemExit:
                pytest.fail(f"{source}/{name}: `baton {' '.join(args)}` does not parse")
            seen.add(args[0])
    assert {"serve", "router"} <= seen and (source == "builds" or "planner" in seen)
