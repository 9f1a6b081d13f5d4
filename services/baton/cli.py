"""`baton` command line.

    baton up [--port 8000] [--workers 2]      a local cluster: router + workers on loopback
    baton serve [--port 8001] [--role both]   one worker (engine + OpenAI API)
    baton router --workers URL,URL            the router in front of running workers
                 --registry redis://HOST:6379/0   ... or of the workers registered in Redis
    baton generate "prompt" ...               offline generation with the local engine
    baton profile | plan | planner            step costs, the P:D plan, the in-cluster scaler
    baton config validate FILE                check a live-tuning file offline
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time


def build_parser() -> argparse.ArgumentParser:
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
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format=f"%(asctime)s %(levelname)s [{args.name}] %(name)s: %(message)s")
    try:
        return args.run(args)
    except ValueError as err:  # invalid configuration: name the field, no traceback
        print(f"baton {args.command}: {err}", file=sys.stderr)
        return 2


def _common(p: argparse.ArgumentParser, name: str) -> None:
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    p.add_argument("--name", default=name, help="this process's name in log lines")


def _model_args(p) -> None:
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: bundled)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    _model_args(g)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-gib", type=float, default=2.0,
                   help="KV cache memory budget when --num-kv-blocks is not given")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority", "static"])
    g.add_argument("--num-threads", type=int, default=None)
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: the Triton kernels on CUDA, torch on CPU")
    g.add_argument("--enforce-eager", action="store_true",
                   help="do not capture CUDA graphs for decode steps")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--max-waiting", type=int, default=256,
                   help="requests waiting to be scheduled before new ones get 429")
    g.add_argument("--kv-transport", "--transport", default=None,
                   choices=["auto", "nixl", "tcp", "gloo", "nccl", "local", "none"],
                   help="KV transfer transport (default for prefill/decode roles: auto = "
                        "nixl when installed, else tcp)")
    g.add_argument("--kv-host", default="127.0.0.1",
                   help="address this worker serves KV pulls on (its pod IP in a cluster)")
    g.add_argument("--kv-port", type=int, default=0,
                   help="port for KV pulls (0: any free one; fix it in a cluster)")
    g.add_argument("--kv-lease-ttl", type=float, default=30.0)
    g.add_argument("--kv-transfer-timeout", type=float, default=30.0)
    g.add_argument("--kv-failure-policy", default="recompute", choices=["recompute", "fail"])


def _engine_config(args):
    from baton.engine.config import EngineConfig

    role = getattr(args, "role", "both")
    transport = args.kv_transport or ("auto" if role != "both" else "none")
    if transport == "auto":
        from baton.kv_transfer import best_transport

        transport = best_transport()
    return EngineConfig(
        kv_transport=None if transport == "none" else transport, kv_host=args.kv_host,
        kv_port=args.kv_port,
        engine_id=f"{role}-{args.port}" if hasattr(args, "port") else None,
        kv_lease_ttl_s=args.kv_lease_ttl, kv_transfer_timeout_s=args.kv_transfer_timeout,
        kv_failure_policy=args.kv_failure_policy,
        model=args.model, dtype=args.dtype, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
        enable_prefix_caching=not args.no_prefix_caching,
        scheduling_policy=args.scheduling_policy, num_threads=args.num_threads,
        device=args.device, attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager)


# -- baton serve -------------------------------------------------------------------------
def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="run one worker (engine + OpenAI API)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--role", default="both", choices=["both", "prefill", "decode"])
    p.add_argument("--registry", default=None, metavar="REDIS_URL",
                   help="register in this Redis (redis://host:6379/0) for routers to find")
    p.add_argument("--advertise-url", default=None,
                   help="the URL routers reach this worker at (default http://HOST:PORT)")
    p.add_argument("--registry-prefix", default="baton",
                   help="key prefix in Redis (one per deployment sharing a Redis)")
    _engine_args(p)
    p.add_argument("--config-dir", default=None,
                   help="a mounted tuning ConfigMap (file baton.yaml, section worker): "
                        "read at start, reloaded live; flags given here win over it")
    _common(p, "worker")
    p.set_defaults(run=_serve, parser=p)


_WORKER_TUNABLES = {k: k for k in ("max_num_seqs", "max_num_batched_tokens",
                                   "kv_failure_policy", "dtype", "num_kv_blocks",
                                   "block_size", "max_model_len")} | {
    "kv_lease_ttl": "kv_lease_ttl_s", "kv_transfer_timeout": "kv_transfer_timeout_s"}


def _serve(args) -> int:
    from baton.common.tuning import ConfigWatcher
    from baton.worker.app import WorkerSettings, WorkerState, build_app
    from baton.worker.tuning import configure

    engine, pinned = _engine_config(args), _pinned(args, _WORKER_TUNABLES)
    watcher = None
    if args.config_dir is not None:  # an invalid file: TuningError, exit 2
        watcher = ConfigWatcher(args.config_dir)
        engine = configure(engine, watcher.load_initial(), pinned)
    settings = WorkerSettings(engine=engine, role=args.role,
                              served_model_name=args.served_model_name,
                              max_waiting=args.max_waiting, pinned=pinned,
                              registry_url=args.registry, registry_prefix=args.registry_prefix,
                              advertise_url=args.advertise_url or _advertise(args))
    state = WorkerState(settings, watcher)
    _run_uvicorn(build_app(settings, state), args.host, args.port, args.log_level)
    if state.load_error is not None:
        print(f"baton serve: the engine failed to load: {state.load_error}", file=sys.stderr)
        return 1
    return 0


def _advertise(args) -> str:
    if args.host in ("0.0.0.0", "::", ""):
        if args.registry:
            raise ValueError("--advertise-url is needed when serving on all interfaces "
                             "with --registry (e.g. http://$(POD_IP):8001)")
    return f"http://{args.host}:{args.port}"


# -- baton router ------------------------------------------------------------------------
def _router_parser(sub) -> None:
    p = sub.add_parser("router", help="run the router in front of running workers")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    found = p.add_mutually_exclusive_group(required=True)
    found.add_argument("--workers", help="comma-separated worker URLs (local mode)")
    found.add_argument("--registry", metavar="REDIS_URL",
                       help="follow the workers registered in this Redis (redis://host:6379/0)")
    p.add_argument("--registry-prefix", default="baton",
                   help="key prefix in Redis (one per deployment sharing a Redis)")
    p.add_argument("--policy", default="load", choices=["load", "round_robin", "random"])
    p.add_argument("--weights", default=None,
                   help="scorer weights for --policy load, e.g. queue=1,kv_usage=0.5")
    p.add_argument("--check-interval", type=float, default=1.0)
    p.add_argument("--max-attempts", type=int, default=3)
    p.add_argument("--connect-timeout", type=float, default=2.0)
    p.add_argument("--first-byte-timeout", type=float, default=600.0)
    p.add_argument("--idle-timeout", type=float, default=120.0)
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--disagg-min-prefill-tokens", type=int, default=256,
                   help="remote prefill for prompts at least this long (estimated)")
    p.add_argument("--prefill-timeout", type=float, default=60.0)
    p.add_argument("--config-dir", default=None,
                   help="a mounted tuning ConfigMap (file baton.yaml, section router): "
                        "reloaded live; flags given here win over it")
    _common(p, "router")
    p.set_defaults(run=_router, parser=p)


def _router(args) -> int:
    from baton.router.app import RouterSettings, run
    from baton.router.proxy import DisaggSettings, ProxySettings

    weights = None
    if args.weights:
        weights = {}
        for item in args.weights.split(","):
            name, _, value = item.partition("=")
            try:
                weights[name.strip()] = float(value)
            except ValueError:
                raise ValueError(f"--weights: {item!r} is not name=number") from None
    settings = RouterSettings(
        workers=tuple(u.strip() for u in (args.workers or "").split(",") if u.strip()),
        registry_url=args.registry, registry_prefix=args.registry_prefix,
        api_key=os.environ.get("BATON_API_KEY") or None,
        policy=args.policy, scorer_weights=weights, check_interval_s=args.check_interval,
        proxy=ProxySettings(max_attempts=args.max_attempts,
                            connect_timeout_s=args.connect_timeout,
                            first_byte_timeout_s=args.first_byte_timeout,
                            idle_timeout_s=args.idle_timeout,
                            request_timeout_s=args.request_timeout),
        disagg=DisaggSettings(args.disagg_min_prefill_tokens, args.prefill_timeout),
        config_dir=args.config_dir, pinned=_pinned(args, _ROUTER_TUNABLES))
    run(settings, args.host, args.port)  # an invalid tuning file: TuningError, exit 2
    return 0


# flag dest -> the tuning file's field it pins
_ROUTER_TUNABLES = {"weights": "scorer_weights", "max_attempts": "max_attempts",
                    "first_byte_timeout": "first_byte_timeout_s",
                    "idle_timeout": "idle_timeout_s", "request_timeout": "request_timeout_s",
                    "disagg_min_prefill_tokens": "disagg_min_prefill_tokens",
                    "prefill_timeout": "prefill_timeout_s"}


def _pinned(args, tunables: dict[str, str]) -> frozenset[str]:
    """Tuning fields set explicitly by a flag (a value other than the flag's default): the
    config file does not override them (defaults < file < flags)."""
    return frozenset(field for dest, field in tunables.items()
                     if getattr(args, dest) != args.parser.get_default(dest))


def _run_uvicorn(app, host: str, port: int, log_level: str) -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False,
                loop="uvloop", http="httptools", timeout_graceful_shutdown=5,
                log_config=None)


# -- baton config ------------------------------------------------------------------------
def _config_parser(sub) -> None:
    p = sub.add_parser("config", help="check a tuning file offline")
    p.add_argument("action", choices=["validate"])
    p.add_argument("file", help="a tuning YAML file (the ConfigMap's baton.yaml)")
    _common(p, "config")
    p.set_defaults(run=_config)


def _config(args) -> int:
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
    p = sub.add_parser("up", help="start a local cluster: router + workers on loopback")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the router's port; workers take "
                                                          "the next ones")
    p.add_argument("--workers", type=int, default=2, help="colocated (role=both) workers")
    p.add_argument("--prefill", type=int, default=0,
                   help="prefill workers (with --decode: a disaggregated cluster)")
    p.add_argument("--decode", type=int, default=0, help="decode workers")
    p.add_argument("--disagg-min-prefill-tokens", type=int, default=256)
    p.add_argument("--policy", default="load", choices=["load", "round_robin", "random"])
    p.add_argument("--ready-timeout", type=float, default=600.0)
    _engine_args(p)
    _common(p, "up")
    p.set_defaults(run=_up)


def _up(args) -> int:
    from baton.launch import Cluster

    return Cluster.from_args(args).run()


# -- baton generate ----------------------------------------------------------------------
def _generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate from prompts with the local engine")
    gen.add_argument("prompts", nargs="+", help="prompt text (one request each)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")
    _model_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    _common(gen, "generate")
    gen.set_defaults(run=_generate, log_level="warning")


def _generate(args) -> int:
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
