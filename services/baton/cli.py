"""`baton` command line.

    baton up [--port 8000] [--workers 2]      a local cluster: router + workers on loopback
    baton serve [--port 8001] [--role both]   one worker (engine + OpenAI API)
    baton router --workers URL,URL            the router in front of running workers
                 --registry redis://HOST:6379/0   ... or of the workers registered in Redis
    baton generate "prompt" ...               offline generation with the local engine
    baton profile | plan | planner            step costs, the P:D plan, the in-cluster scaler
    baton config validate FILE                check a live-tuning file offline
"""

# Flag defaults are read from the dataclass each flag fills (EngineConfig, the router's
# settings, Cluster), never repeated here. Service modules are imported inside functions:
# `import baton.cli` stays torch-free, and no parser imports the engine.

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from functools import partial

from baton.cli_common import (
    add_common_flags,
    add_model_flags,
    add_worker_flags,
    engine_config,
    field_default,
)
from baton.cli_router import (
    disagg_default,
    disagg_flag,
    parse_weights,
    policy_flag,
    proxy_flags,
)
from baton.common.roles import ROLE_NAMES, Role
from baton.engine.config import EngineConfig


def build_parser() -> argparse.ArgumentParser:
    """The `baton` parser; each subcommand's namespace carries `run(args) -> exit code`."""
    parser = argparse.ArgumentParser(prog="baton", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _router_parser(sub)
    _up_parser(sub)
    _config_parser(sub)
    from baton.planner.cli import add_subcommands

    add_subcommands(sub)  # profile | plan | planner
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, set up logging and run the subcommand; a ValueError (an invalid flag or
    config field, whose message names it) is printed without a traceback: exit code 2."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format=f"%(asctime)s %(levelname)s [{args.name}] %(name)s: %(message)s")
    try:
        return args.run(args)
    except ValueError as err:  # invalid configuration: name the field, no traceback
        print(f"baton {args.command}: {err}", file=sys.stderr)
        return 2


# -- baton serve -------------------------------------------------------------------------
def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="run one worker (engine + OpenAI API)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--role", default=Role.BOTH.value, choices=ROLE_NAMES)
    _registry_flag(p, "register in this Redis (redis://[:password@]host:6379/0, rediss:// "
                      "for TLS) for routers to find")
    p.add_argument("--advertise-url", default=None,
                   help="the URL routers reach this worker at (default http://HOST:PORT)")
    _registry_prefix_flag(p)
    _header_timeout_flag(p)
    p.add_argument("--otlp-endpoint", default=None,
                   help="export OpenTelemetry traces to this OTLP/HTTP collector "
                        "(default: $OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT; none: off)")
    add_worker_flags(p)
    p.add_argument("--config-dir", default=None,
                   help="a mounted tuning ConfigMap (file baton.yaml, section worker): "
                        "read at start, reloaded live; flags given here win over it")
    add_common_flags(p, "worker")
    p.set_defaults(run=_serve, parser=p)


def _registry_flag(p, help_text: str, **kwargs) -> None:
    """`--registry`, by default `$BATON_REDIS_URL` (a URL with a password stays out of the
    process's arguments)."""
    p.add_argument("--registry", default=os.environ.get("BATON_REDIS_URL") or None,
                   metavar="REDIS_URL", help=help_text + " (default: $BATON_REDIS_URL)",
                   **kwargs)


def _header_timeout_flag(p) -> None:
    from baton.common.http_limits import HEADER_TIMEOUT_S

    p.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S,
                   help="seconds a request's line and headers may take to arrive before "
                        "the connection is closed (slow clients, slowloris)")


def _registry_prefix_flag(p) -> None:
    from baton.common.registry import DEFAULT_PREFIX

    p.add_argument("--registry-prefix", default=DEFAULT_PREFIX,
                   help="key prefix in Redis (one per deployment sharing a Redis)")


# flag dest -> the tuning file's worker field it pins
_WORKER_TUNABLES = {k: k for k in ("max_num_seqs", "max_num_batched_tokens",
                                   "kv_failure_policy", "dtype", "num_kv_blocks",
                                   "block_size", "max_model_len")} | {
    "kv_lease_ttl": "kv_lease_ttl_s", "kv_transfer_timeout": "kv_transfer_timeout_s"}


def _serve(args) -> int:
    """Run the worker until it is stopped; 1 when its engine failed to load."""
    from baton.common.tuning import ConfigWatcher
    from baton.worker.app import build_app
    from baton.worker.lifecycle import serve
    from baton.worker.state import WorkerState
    from baton.worker.tuning import configure

    engine, pinned = engine_config(args), _pinned(args, _WORKER_TUNABLES)
    watcher = None
    if args.config_dir is not None:  # an invalid file: TuningError, exit 2
        watcher = ConfigWatcher(args.config_dir)
        engine = configure(engine, watcher.load_initial(), pinned)
    settings = _worker_settings(args, engine, pinned)
    state = WorkerState(settings, watcher, freeze_heap=True)
    serve(build_app(settings, state), state, args.host, args.port, args.log_level,
          settings.drain_timeout_s, args.header_timeout)
    if state.load_error is not None:
        print(f"baton serve: the engine failed to load: {state.load_error}", file=sys.stderr)
        return 1
    return state.exit_code


def _worker_settings(args, engine: EngineConfig, pinned: frozenset[str]):
    """The WorkerSettings of `baton serve`'s flags; an unset `--max-waiting` leaves
    WorkerSettings' default. Raises ValueError for an invalid combination."""
    from baton.common.auth import internal_token
    from baton.common.tracing import otlp_endpoint
    from baton.worker.state import WorkerSettings

    given = {name: getattr(args, dest) for dest, name in (
        ("max_waiting", "max_waiting"), ("drain_timeout", "drain_timeout_s"),
        *((n, n) for n in ("tool_call_parser", "reasoning_parser", "stream_interval",
                            "engine_process")))
        if getattr(args, dest) is not None}  # unset: WorkerSettings' defaults
    api_key = os.environ.get("BATON_API_KEY")
    return WorkerSettings(engine=engine, role=Role(args.role),
                          served_model_name=args.served_model_name, pinned=pinned,
                          registry_url=args.registry, registry_prefix=args.registry_prefix,
                          advertise_url=args.advertise_url or _advertise(args),
                          internal_token=internal_token(),
                          otlp_endpoint=otlp_endpoint(args.otlp_endpoint, os.environ),
                          api_keys=(api_key,) if api_key else (), **given)


def _advertise(args) -> str:
    if args.host in ("0.0.0.0", "::", ""):
        if args.registry:
            raise ValueError("--advertise-url is needed when serving on all interfaces "
                             "with --registry (e.g. http://$(POD_IP):8001)")
    return f"http://{args.host}:{args.port}"


# -- baton router ------------------------------------------------------------------------
def _router_parser(sub) -> None:
    from baton.router.settings import RouterSettings

    p = sub.add_parser("router", help="run the router in front of running workers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    found = p.add_mutually_exclusive_group()  # one of them, or $BATON_REDIS_URL
    found.add_argument("--workers", help="comma-separated worker URLs (local mode)")
    _registry_flag(found, "follow the workers registered in this Redis "
                          "(redis://[:password@]host:6379/0, rediss:// for TLS)")
    _registry_prefix_flag(p)
    policy_flag(p)
    p.add_argument("--weights", default=None,
                   help="scorer weights for --policy load, e.g. queue=1,kv_usage=0.5")
    p.add_argument("--check-interval", type=float,
                   default=field_default(RouterSettings, "check_interval_s"))
    proxy_flags(p)
    disagg_flag(p)
    p.add_argument("--prefill-timeout", type=float, default=disagg_default("prefill_timeout_s"))
    p.add_argument("--config-dir", default=None,
                   help="a mounted tuning ConfigMap (file baton.yaml, section router): "
                        "reloaded live; flags given here win over it")
    p.add_argument("--api-keys-file", default=None, metavar="PATH",
                   help="tenants' keys and rate limits (YAML; default $BATON_API_KEYS_FILE)")
    _header_timeout_flag(p)
    p.add_argument("--otlp-endpoint", default=None, metavar="URL", help="OTLP/HTTP trace "
                   "collector (default $OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT; none: off)")
    add_common_flags(p, "router")
    p.set_defaults(run=_router, parser=p)


def _router(args) -> int:
    """Run the router until it is stopped (an invalid tuning file: TuningError, exit 2)."""
    from baton.router.app import run

    run(_router_settings(args), args.host, args.port)
    return 0


def _router_settings(args):
    """The RouterSettings of `baton router`'s flags and $BATON_API_KEY[S_FILE],
    $BATON_INTERNAL_TOKEN[_FILE], $OTEL_EXPORTER_OTLP_*. Raises ValueError naming a bad
    flag or field."""
    from baton.common.auth import internal_token
    from baton.common.tracing import otlp_endpoint
    from baton.router.settings import DisaggSettings, ProxySettings, RouterSettings
    from baton.router.tenants import KEYS_FILE_ENV, load_tenants

    weights = parse_weights(args.weights)
    keys_file = args.api_keys_file or os.environ.get(KEYS_FILE_ENV) or None
    return RouterSettings(
        workers=tuple(u.strip() for u in (args.workers or "").split(",") if u.strip()),
        registry_url=None if args.workers else args.registry,
        registry_prefix=args.registry_prefix, api_key=os.environ.get("BATON_API_KEY") or None,
        tenants=load_tenants(keys_file) if keys_file else (), internal_token=internal_token(),
        header_timeout_s=args.header_timeout,
        otlp_endpoint=otlp_endpoint(args.otlp_endpoint, os.environ),
        policy=args.policy, scorer_weights=weights, check_interval_s=args.check_interval,
        proxy=ProxySettings(max_attempts=args.max_attempts,
                            connect_timeout_s=args.connect_timeout,
                            first_byte_timeout_s=args.first_byte_timeout,
                            idle_timeout_s=args.idle_timeout,
                            request_timeout_s=args.request_timeout),
        disagg=DisaggSettings(min_prefill_tokens=args.disagg_min_prefill_tokens,
                              prefill_timeout_s=args.prefill_timeout,
                              peer_fetch=args.peer_fetch,
                              peer_fetch_min_tokens=args.peer_fetch_min_tokens),
        config_dir=args.config_dir, pinned=_pinned(args, _ROUTER_TUNABLES))


# flag dest -> the tuning file's router field it pins
_ROUTER_TUNABLES = {"weights": "scorer_weights", "max_attempts": "max_attempts",
                    "first_byte_timeout": "first_byte_timeout_s",
                    "idle_timeout": "idle_timeout_s", "request_timeout": "request_timeout_s",
                    "disagg_min_prefill_tokens": "disagg_min_prefill_tokens",
                    "prefill_timeout": "prefill_timeout_s", "peer_fetch": "peer_fetch",
                    "peer_fetch_min_tokens": "peer_fetch_min_tokens"}


def _pinned(args, tunables: dict[str, str]) -> frozenset[str]:
    """Tuning fields set explicitly by a flag (a value other than the flag's default): the
    config file does not override them (defaults < file < flags)."""
    return frozenset(field for dest, field in tunables.items()
                     if getattr(args, dest) != args.parser.get_default(dest))


# -- baton config ------------------------------------------------------------------------
def _config_parser(sub) -> None:
    p = sub.add_parser("config", help="check a tuning file offline")
    p.add_argument("action", choices=["validate"])
    p.add_argument("file", help="a tuning YAML file (the ConfigMap's baton.yaml)")
    add_common_flags(p, "config")
    p.set_defaults(run=_config)


def _config(args) -> int:
    """Print what the tuning file sets, section by section; a bad file raises TuningError."""
    from baton.common.tuning import load_tuning, set_fields
    from baton.router.scheduling.pipeline import RoutingPipeline

    tuning = load_tuning(args.file)  # the same code the services reload with
    if tuning.router.scorer_weights is not None:  # names checked as the router checks them
        RoutingPipeline.from_policy("load", tuning.router.scorer_weights)
    for section in ("router", "worker"):
        fields = set_fields(getattr(tuning, section))
        print(f"{section}: {', '.join(f'{k}={v}' for k, v in fields.items()) or '(nothing)'}")
    restart = {k: v for k, v in tuning.worker.restart.model_dump().items() if v is not None}
    if restart:
        print(f"worker.restart (applied at start only): {restart}")
    print(f"{args.file}: valid")
    return 0


# -- baton up ----------------------------------------------------------------------------
def _up_parser(sub) -> None:
    from baton.launch import Cluster

    cluster = partial(field_default, Cluster)
    p = sub.add_parser("up", help="start a local cluster: router + workers on loopback")
    p.add_argument("--host", default=cluster("host"))
    p.add_argument("--port", type=int, default=cluster("port"),
                   help="the router's port; workers take the next ones")
    p.add_argument("--workers", type=int, default=cluster("num_workers"),
                   help="colocated (role=both) workers")
    p.add_argument("--prefill", type=int, default=cluster("num_prefill"),
                   help="prefill workers (with --decode: a disaggregated cluster)")
    p.add_argument("--decode", type=int, default=cluster("num_decode"), help="decode workers")
    for role in ("prefill", "decode"):
        p.add_argument(f"--{role}-tp", type=int, default=cluster(f"{role}_tp"),
                       help=f"tensor-parallel ranks of each {role} worker")
    disagg_flag(p)
    policy_flag(p)
    p.add_argument("--ready-timeout", type=float, default=cluster("ready_timeout_s"))
    add_worker_flags(p)
    add_common_flags(p, "up")
    p.set_defaults(run=_up)


def _up(args) -> int:
    from baton.launch import Cluster

    return Cluster.from_args(args).run()


# -- baton generate ----------------------------------------------------------------------
def _generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate from prompts with the local engine")
    gen.add_argument("prompts", nargs="+", help="prompt text (one request each)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")
    add_model_flags(gen)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    add_common_flags(gen, "generate")
    gen.set_defaults(run=_generate, log_level="warning")


def _generate(args) -> int:
    """Generate for each prompt with the offline `LLM`, print the texts, timings on stderr."""
    from baton import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype)
    print(f"[engine ready in {time.perf_counter() - t0:.1f}s]", file=sys.stderr)
    t0 = time.perf_counter()
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params,
                        use_tqdm=False)
    else:
        outs = llm.generate(args.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    for prompt, out in zip(args.prompts, outs):
        print(f">>> {prompt}\n{out.outputs[0].text}\n[{out.outputs[0].finish_reason}]")
    print(f"[{n_tokens} tokens in {elapsed:.2f}s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
