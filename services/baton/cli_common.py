"""Flags shared by several `baton` subcommands, in a module that both `baton.cli` and
`baton.planner.cli` import (neither imports the other for them): `--log-level` / `--name`
on every subcommand, and the engine's flags (`baton serve`, `baton up`; `--model` /
`--dtype` also in `baton generate` and `baton profile`).

Defaults are read from the dataclass a flag fills (`field_default`, `EngineConfig.default`),
so each lives in one place. Torch-free: `baton.engine.config` imports nothing heavy.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from baton.common.auth import internal_token
from baton.common.roles import Role
from baton.engine.config import (
    ATTENTION_BACKENDS,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_KV_CACHE_BYTES,
    DEVICES,
    DTYPES,
    ENGINE_PROCESS_MODES,
    KV_CACHE_DTYPES,
    KV_FAILURE_POLICIES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    EngineConfig,
)
from baton.kv_transfer import TRANSPORTS

LOG_LEVELS = ("debug", "info", "warning", "error")
# worker.tool_parsers.PARSER_CHOICES, spelled out: importing the parsers costs every
# command ~0.3 s (a test keeps the two equal)
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "none")
# worker.reasoning.REASONING_PARSER_CHOICES, spelled out for the same reason
REASONING_PARSERS = ("none", "auto", "qwen3", "deepseek_r1")
_GIB = 1 << 30


def add_common_flags(p: argparse.ArgumentParser, name: str) -> None:
    """Add `--log-level` and `--name` (this process's name in log lines, default `name`) to
    the subcommand parser `p`; `baton.cli.main` reads both before running the command."""
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    p.add_argument("--name", default=name, help="this process's name in log lines")


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass `cls`'s field `name` (a `default_factory` is called).

    Raises ValueError when `cls` has no such field or the field has no default: a flag whose
    default is read from a renamed field fails when the parser is built, not later."""
    for f in dataclasses.fields(cls):
        if f.name != name:
            continue
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        raise ValueError(f"{cls.__name__}.{name} has no default")
    raise ValueError(f"{cls.__name__} has no field {name!r}")


engine_default = EngineConfig.default


# -- the engine's flags -------------------------------------------------------------------
def add_model_flags(p) -> None:
    """`--model` and `--dtype` on `p` (a parser or an argument group)."""
    p.add_argument("--model", default=engine_default("model"),
                   help="HF directory or .gguf (default: bundled)")
    p.add_argument("--dtype", default=engine_default("dtype"), choices=DTYPES)


WORKER_GROUP = "worker"


def add_worker_flags(p: argparse.ArgumentParser) -> None:
    """The `worker` flag group of `baton serve`, which `baton up` takes too and passes on to
    every worker (`worker_flag_args`): the engine's flags (`engine_config` turns them into
    an EngineConfig) and the worker's own."""
    g = p.add_argument_group(WORKER_GROUP)
    add_model_flags(g)
    _checkpoint_flags(g)
    _batching_flags(g)
    _kv_tier_flags(g)
    _parallel_flags(g)
    _lora_flags(g)
    # None: WorkerSettings' defaults, applied where the settings are built (reading them
    # here would import the worker, and torch, into every `baton` command)
    g.add_argument("--max-waiting", type=int, default=None,
                   help="requests waiting to be scheduled before new ones get 429 "
                        "(default: WorkerSettings.max_waiting)")
    g.add_argument("--drain-timeout", type=float, default=None,
                   help="on SIGTERM: seconds in-flight requests (and held KV leases) may "
                        "take before the worker stops (default: WorkerSettings."
                        "drain_timeout_s)")
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="how tool_choice auto answers are read: auto picks the format from "
                        "the chat template (hermes when it does not tell); none refuses "
                        "them (default: WorkerSettings.tool_call_parser)")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split a reasoning model's <think> thinking from its answer "
                        "(reasoning_content in chat, reasoning items in responses; "
                        "structured outputs start after it): qwen3, deepseek_r1, auto from "
                        "the chat template; none leaves the thinking in the content "
                        "(default: WorkerSettings.reasoning_parser)")
    g.add_argument("--stream-interval", type=int, default=None,
                   help="stream a request's tokens in SSE chunks of at least this many (the "
                        "first and last at once): less front work per token, chunkier gaps "
                        "(default: WorkerSettings.stream_interval, 1)")
    g.add_argument("--engine-process", default=None, choices=ENGINE_PROCESS_MODES,
                   help="run the engine core in its own process beside the HTTP front "
                        "(vLLM's engine-core process): the two never share a GIL, a step's "
                        "outputs cross in one message; auto: on for a GPU and the simulated "
                        "device, off on the CPU (default: WorkerSettings.engine_process)")
    _kv_transfer_flags(g)


def worker_flag_args(args: argparse.Namespace) -> list[str]:
    """The `baton serve` arguments that reproduce every worker flag in `args` whose value
    is not its default (a worker's own default is the same one)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_worker_flags(parser)
    out: list[str] = []
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list
        value = getattr(args, action.dest, action.default)
        if not action.option_strings or value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001
            out.append(flag)
        elif isinstance(value, list):  # nargs="+"
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def _checkpoint_flags(g) -> None:
    """Which checkpoint revision, its tokenizer, and the names it is served under."""
    g.add_argument("--revision", default=engine_default("revision"),
                   help="a hub model's branch, tag or commit (--model ORG/NAME or hf://; "
                        "default: main), read from the local hub cache")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   default=engine_default("skip_tokenizer_init"),
                   help="load no tokenizer (a checkpoint without one): token-id prompts "
                        "only, outputs carry token ids and no text")
    g.add_argument("--quantization", default=engine_default("quantization"),
                   choices=QUANTIZATIONS,
                   help="auto (default): a .gguf's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K linears "
                        "served as stored (CPU, bfloat16; other GGUF types refused by name); "
                        "none: de-quantized at load")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name(s) requests may use for this model, the first reported "
                        "in responses (default: the --model argument)")


def _kv_tier_flags(g) -> None:
    g.add_argument("--kv-offload-gib", type=float, default=engine_default("kv_offload_gib"),
                   help="host memory for the KV offload tier under the pool: blocks the "
                        "pool evicts are kept there and loaded back on a prefix hit "
                        "(default 0: none)")
    g.add_argument("--kv-disk-dir", default=engine_default("kv_disk_dir"),
                   help="a directory for the KV disk tier under the host tier (needs "
                        "--kv-offload-gib and --kv-disk-gib): blocks the host tier evicts, "
                        "and all it holds at a graceful stop, so a restart comes back warm")
    g.add_argument("--kv-disk-gib", type=float, default=engine_default("kv_disk_gib"),
                   help="the disk tier's size (default 0: none)")


def _batching_flags(g) -> None:
    g.add_argument("--block-size", type=int, default=engine_default("block_size"))
    g.add_argument("--max-num-seqs", type=int, default=engine_default("max_num_seqs"))
    g.add_argument("--max-num-batched-tokens", type=int,
                   default=engine_default("max_num_batched_tokens"))
    g.add_argument("--max-model-len", type=int, default=engine_default("max_model_len"))
    g.add_argument("--num-kv-blocks", type=int, default=engine_default("num_kv_blocks"))
    g.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV cache memory budget when --num-kv-blocks is not given "
                        f"(default: {DEFAULT_KV_CACHE_BYTES / _GIB:g} off CUDA; on CUDA the "
                        "pool is sized by --gpu-memory-utilization)")
    g.add_argument("--gpu-memory-utilization", type=float,
                   default=engine_default("gpu_memory_utilization"),
                   help="on CUDA, the fraction of the GPU's memory this worker may use: "
                        "the KV pool gets what the weights and a profiled forward at the "
                        "largest batch leave (default: "
                        f"{DEFAULT_GPU_MEMORY_UTILIZATION}; two workers on one GPU each "
                        "take their own fraction)")
    g.add_argument("--kv-cache-dtype", default=engine_default("kv_cache_dtype"),
                   choices=KV_CACHE_DTYPES,
                   help="KV cache storage: auto = the model's dtype; fp8 (= fp8_e4m3) or "
                        "fp8_e5m2 halve bf16's bytes per block, with the checkpoint's "
                        "k/v scales (1.0 without)")
    g.add_argument("--no-prefix-caching", action="store_true",
                   default=not engine_default("enable_prefix_caching"))
    g.add_argument("--scheduling-policy", default=engine_default("scheduling_policy"),
                   choices=SCHEDULING_POLICIES,
                   help="fcfs / priority: continuous batching; static: fixed groups run to "
                        "completion (a baseline); dynamic: static groups collected within "
                        "--batch-window-ms")
    g.add_argument("--batch-window-ms", type=float, default=engine_default("batch_window_ms"),
                   help="the dynamic policy's collection window")
    g.add_argument("--async-scheduling", default="auto", choices=("auto", "on", "off"),
                   help="schedule the next step while the device runs this one, its "
                        "tokens filled in when read (auto: where the device runs "
                        "asynchronously to the host: --device sim)")
    g.add_argument("--speculative-config", default=engine_default("speculative_config"),
                   help='speculative decoding, a JSON object: {"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                        '"prompt_lookup_min": 2}; method suffix also looks in recent outputs, '
                        'method draft_model runs the model "draft_model" names '
                        '(docs/operate.md)')
    g.add_argument("--num-threads", type=int, default=engine_default("num_threads"))
    g.add_argument("--device", default=engine_default("device"), choices=DEVICES,
                   help="sim: a simulated GPU (with --sim-profile): modelled step times and "
                        "nonsense tokens, to measure the host path (docs/operate.md)")
    g.add_argument("--sim-profile", default=engine_default("sim_profile"),
                   help="--device sim's device x model: a bundled profile (h100-llama3-8b, "
                        "h200-llama3-8b) or a YAML file")
    g.add_argument("--attention-backend", default=engine_default("attention_backend"),
                   choices=ATTENTION_BACKENDS,
                   help="auto: the Triton kernels on CUDA, torch on CPU")
    g.add_argument("--enforce-eager", action="store_true",
                   default=engine_default("enforce_eager"),
                   help="do not capture CUDA graphs for decode steps")
    g.add_argument("--deterministic", action="store_true",
                   default=engine_default("deterministic"),
                   help="batch-invariant forward passes (CPU only, one rank): greedy output "
                        "does not depend on the batch, so stream resume and P/D stay exact "
                        "in bf16; slower (docs/operate.md)")


def _parallel_flags(g) -> None:
    g.add_argument("--tensor-parallel-size", "-tp", type=int,
                   default=engine_default("tensor_parallel_size"),
                   help="split the model over this many ranks, one process (and GPU) each; "
                        "--num-threads is then per rank")
    g.add_argument("--tp-step-timeout", type=float,
                   default=engine_default("tp_step_timeout_s"),
                   help="seconds one tensor-parallel step may take before the engine is "
                        "failed (a stopped or hung rank); the worker then exits non-zero")


def _lora_flags(g) -> None:
    """Multi-LoRA serving (`engine.lora`), vLLM's flags."""
    g.add_argument("--enable-lora", action="store_true", default=engine_default("enable_lora"),
                   help="serve LoRA adapters (implied by --lora-modules; loaded at run time "
                        "with POST /v1/load_lora_adapter)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="PEFT adapters served at start: a request's model NAME runs the one "
                        "at PATH (a directory, a hub cache repo or hf://ORG/NAME)")
    g.add_argument("--max-loras", type=int, default=engine_default("max_loras"),
                   help="adapters resident at once (a step holds at most this many)")
    g.add_argument("--max-lora-rank", type=int, default=engine_default("max_lora_rank"),
                   help="adapters of a higher rank are refused")
    g.add_argument("--max-cpu-loras", type=int, default=engine_default("max_cpu_loras"),
                   help="host copies of adapters kept (default: --max-loras)")


def _kv_transfer_flags(g) -> None:
    g.add_argument("--kv-transport", "--transport", default=None,
                   choices=["auto", *TRANSPORTS, "none"],
                   help="KV transfer transport (default for prefill/decode roles: auto = "
                        "nixl when installed, else tcp)")
    g.add_argument("--kv-host", default=engine_default("kv_host"),
                   help="address this worker serves KV pulls on (its pod IP in a cluster)")
    g.add_argument("--kv-port", type=int, default=engine_default("kv_port"),
                   help="port for KV pulls (0: any free one; fix it in a cluster)")
    g.add_argument("--kv-lease-ttl", type=float, default=engine_default("kv_lease_ttl_s"))
    g.add_argument("--kv-transfer-timeout", type=float,
                   default=engine_default("kv_transfer_timeout_s"))
    g.add_argument("--kv-failure-policy", default=engine_default("kv_failure_policy"),
                   choices=KV_FAILURE_POLICIES)


# flag dest -> the EngineConfig field it sets as given
_ENGINE_FIELDS = {dest: dest for dest in (
    "model", "revision", "skip_tokenizer_init", "dtype", "quantization", "block_size",
    "max_num_seqs",
    "max_num_batched_tokens", "max_model_len",
    "num_kv_blocks", "gpu_memory_utilization", "kv_cache_dtype", "kv_offload_gib",
    "kv_disk_dir", "kv_disk_gib", "scheduling_policy", "batch_window_ms",
    "speculative_config",
    "num_threads", "device", "sim_profile", "attention_backend", "enforce_eager",
    "deterministic",
    "tensor_parallel_size", "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras",
    "kv_host", "kv_port", "kv_failure_policy")} | {
    "kv_lease_ttl": "kv_lease_ttl_s", "kv_transfer_timeout": "kv_transfer_timeout_s",
    "tp_step_timeout": "tp_step_timeout_s"}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig that the engine flags in `args` (`baton serve` or `baton up`) give.

    Without `--kv-transport` a `both` worker has none and prefill/decode workers the best one
    installed. Raises ValueError naming the first bad field."""
    role = Role(getattr(args, "role", Role.BOTH))
    return EngineConfig.from_args(
        **{field: getattr(args, dest) for dest, field in _ENGINE_FIELDS.items()},
        kv_transport=_kv_transport(args.kv_transport, role, args.tensor_parallel_size),
        engine_id=f"{role}-{args.port}" if hasattr(args, "port") else None,
        kv_cache_memory_bytes=(None if args.kv_cache_gib is None
                               else int(args.kv_cache_gib * _GIB)),
        enable_prefix_caching=not args.no_prefix_caching,
        async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
        lora_modules=args.lora_modules or (),
        kv_secret=internal_token())  # the deployment's internal token keys the KV port


def _kv_transport(flag: str | None, role: Role, tp: int = 1) -> str | None:
    """EngineConfig.kv_transport for `--kv-transport flag` (None: the role's default;
    `auto` is tcp for a tensor-parallel engine, the one transport moving each rank's
    heads)."""
    transport = flag or ("none" if role == Role.BOTH else "auto")
    if transport == "auto" and tp > 1:
        return "tcp"
    if transport == "auto":
        from baton.kv_transfer import best_transport

        transport = best_transport()
    return None if transport == "none" else transport
