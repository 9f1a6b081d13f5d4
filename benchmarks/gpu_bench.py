"""GPU benchmark: the Triton decode-attention kernel and the engine's decode throughput, both
against the device's copy bandwidth measured in the same run.

    make bench-gpu                                   # both, default sizes, on CUDA
    python -m benchmarks.gpu_bench kernels [--batches 1,4,16,64,256]
        [--contexts 512,2048,8192,32768] [--dtype bfloat16] [--block-size 16]
    python -m benchmarks.gpu_bench engine [--decode-batches 1,32,256] [--prompt-len 128]
        [--max-tokens 128] [--enforce-eager] [--attention-backend triton]
        [--async-scheduling off|on|both]
    python -m benchmarks.gpu_bench all [--shape tiny] [--json result.json]

What is measured:

- copy bandwidth: ``dst.copy_(src)`` of one large buffer (2 GiB on CUDA), best of
  ``--repeats`` after warm-up, timed with CUDA events. It counts the bytes moved, read + write
  (2 x size): the device's achievable memory traffic rate, the yardstick for both parts below.
- kernels: ``baton_kernels.paged_decode_attention`` at the model's attention shape
  (Llama-3-8B: 32 heads, 8 KV heads, head dim 128, bf16) over batch x context points; every
  sequence holds the full context, its block table is a random permutation of physical
  blocks. Median time from ``triton.testing.do_bench`` (which clears L2 between calls, so
  small points read DRAM too). Achieved bandwidth = K and V bytes read / time; its fraction of
  the copy bandwidth is the figure of merit (the issue asks >= 70% at large batch x context).
  Points whose KV does not fit in 60% of the free device memory are skipped.
- engine: ``EngineCore`` with ``load_format="dummy"`` on a model directory holding only a
  Llama-3-8B ``config.json`` (and the bundled tokenizer), so random weights of the real shape.
  For each decode batch B: B requests of random prompt ids, prefill untimed until every one
  has its first token, two untimed decode steps, then the decode steps in which all B are
  still running are timed one by one (``step()`` returns host ints, so each step has synced).
  Output tokens/s = B x steps / time. ``--async-scheduling both`` (the default) times every
  batch twice on the same engine: synchronous steps, then (all batches again) steps launched
  ahead of the host (``runner/ahead.py``), whose device time the engine takes from CUDA
  events ("busy": device time / wall time; in a synchronous row, the share of the wall the
  host waited on the step). A row that fails is recorded as such and the run goes on.
- the simulated device beside it (``benchmarks/sim_calibration.py``): each row's "sim ms" is
  the step the bundled profile of this GPU (H200 by name, else H100) models for the same
  shape, batch and contexts, and the roofline fitted to the rows (step time against the
  bytes and FLOPs of each) gives the profile's ``memory_bandwidth_gbs``, ``peak_tflops`` and
  ``launch_us`` as this GPU measures them.
- weight-streaming floor: a batch-1 decode step reads every weight once, so it cannot beat
  weight bytes / copy bandwidth. The copy rate counts read + write bytes; reading the weights
  is that many bytes of traffic, so the floor divides by the same rate (the stricter choice:
  counting the copy as size / time would double the floor and halve the ratio). The issue
  asks step / floor <= 1.5x.

On a machine without a GPU everything runs on CPU at tiny sizes (for the smoke test), the
kernels only in Triton's interpreter: set ``TRITON_INTERPRET=1`` before starting, e.g.
``TRITON_INTERPRET=1 python -m benchmarks.gpu_bench all --shape tiny --batches 1,2
--contexts 64,256 --decode-batches 1,4 --prompt-len 16 --max-tokens 8``.

The last line printed is the JSON of every number (also written to ``--json PATH``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.sim_calibration import (
    calibrate,
    decode_contexts,
    modelled_ms,
    profile_for,
    step_work,
    with_shape,
)
from benchmarks.timing import measure_copy_bandwidth, release, time_calls

GIB = 1 << 30
MIB = 1 << 20
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DECODE_WARMUP_STEPS = 2
KERNEL_TARGET = 0.70   # fraction of copy bandwidth at large batch x context
FLOOR_TARGET = 1.5     # batch-1 decode step over the weight-streaming floor


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    def config_json(self) -> dict:
        """A Llama-3-8B style config.json of this shape, with the llama3 RoPE scaling Meta
        ships (transformers warns that its original length is not below the 8192 positions
        served here; the engine does not mind)."""
        cfg = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 8192, "tie_word_embeddings": False, "hidden_act": "silu",
            "attention_bias": False, "torch_dtype": "bfloat16",
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192},
        }
        if self.vocab_size > 128001:  # Llama 3's special ids, only where the vocab holds them
            cfg.update(bos_token_id=128000, eos_token_id=128001)
        return cfg


SHAPES = {
    "llama3-8b": ModelShape(layers=32, hidden_size=4096, intermediate_size=14336, num_heads=32,
                            num_kv_heads=8, head_dim=128, vocab_size=128256),
    "tiny": ModelShape(layers=2, hidden_size=256, intermediate_size=512, num_heads=4,
                       num_kv_heads=2, head_dim=64, vocab_size=49152),
}
SHAPE_OVERRIDES = ("layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                   "head_dim", "vocab_size")
FIRST_PROMPT_ID, TOKENIZER_VOCAB = 256, 49152  # the bundled tokenizer's ordinary ids


# -- kernels -----------------------------------------------------------------------------------
def kv_bytes(batch: int, context: int, shape: ModelShape, dtype: torch.dtype) -> int:
    elem = torch.finfo(dtype).bits // 8
    return batch * context * shape.num_kv_heads * shape.head_dim * 2 * elem  # K and V


def time_decode_attention(batch: int, context: int, shape: ModelShape, dtype: torch.dtype,
                          block_size: int, device: torch.device, repeats: int) -> float:
    """Median seconds of one paged_decode_attention call over full-context sequences."""
    from baton_kernels import paged_decode_attention

    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    block_tables = torch.randperm(num_blocks, dtype=torch.int32, device=device).view(
        batch, blocks_per_seq)                                           # (B, max_blocks)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, shape.num_heads, shape.head_dim, dtype=dtype, device=device)
    scale = shape.head_dim ** -0.5

    def call():
        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)

    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median") / 1e3
    return statistics.median(time_calls(call, device, repeats, warmup=1))


def kv_memory_limit(args: argparse.Namespace, device: torch.device) -> int:
    if args.mem_limit_gib is not None:
        return int(args.mem_limit_gib * GIB)
    if device.type == "cuda":
        return int(0.6 * torch.cuda.mem_get_info(device)[0])
    return 256 * MIB


def run_kernels(args: argparse.Namespace, device: torch.device, shape: ModelShape,
                copy_gbps: float) -> dict:
    dtype = DTYPES[args.dtype]
    limit = kv_memory_limit(args, device)
    print(f"\ndecode attention: {shape.num_heads} heads, {shape.num_kv_heads} KV heads, head "
          f"dim {shape.head_dim}, {args.dtype}, blocks of {args.block_size} tokens; KV limit "
          f"{limit / GIB:.3g} GiB")
    print(f"{'batch':>7}{'context':>9}{'time us':>11}{'GB/s':>10}{'% of copy':>11}")
    points = []
    for batch in args.batches:
        for context in args.contexts:
            need = kv_bytes(batch, context, shape, dtype)
            if need > limit:
                print(f"{batch:>7}{context:>9}   skipped: needs {need / GIB:.3g} GiB")
                points.append({"batch": batch, "context": context, "kv_bytes": need,
                               "skipped": True})
                continue
            seconds = time_decode_attention(batch, context, shape, dtype, args.block_size,
                                            device, args.repeats)
            release(device)  # the point's caches, freed on return
            gbps = need / seconds / 1e9
            points.append({"batch": batch, "context": context, "kv_bytes": need,
                           "time_us": seconds * 1e6, "gbps": gbps,
                           "fraction_of_copy": gbps / copy_gbps, "skipped": False})
            print(f"{batch:>7}{context:>9}{seconds * 1e6:>11.1f}{gbps:>10.4g}"
                  f"{100 * gbps / copy_gbps:>10.3g}%")
    return {"shape": dataclasses.asdict(shape), "dtype": args.dtype,
            "block_size": args.block_size, "kv_limit_bytes": limit, "points": points,
            "best_large": summarize_kernels(points)}


def summarize_kernels(points: list[dict]) -> dict | None:
    """Best fraction among the large points: batch >= 1/4 of the largest measured batch and
    context >= 1/4 of the largest measured context (64 x 8192 with the default grid)."""
    ran = [p for p in points if not p["skipped"]]
    if not ran:
        print("no kernel point fit in memory")
        return None
    min_batch = max(1, max(p["batch"] for p in ran) // 4)
    min_context = max(1, max(p["context"] for p in ran) // 4)
    large = [p for p in ran if p["batch"] >= min_batch and p["context"] >= min_context]
    best = max(large, key=lambda p: p["fraction_of_copy"])
    met = best["fraction_of_copy"] >= KERNEL_TARGET
    print(f"best at batch >= {min_batch} x context >= {min_context}: "
          f"{100 * best['fraction_of_copy']:.3g}% of copy bandwidth (batch {best['batch']}, "
          f"context {best['context']}); target >= {KERNEL_TARGET:.0%}: "
          f"{'met' if met else 'not met'}")
    return {"min_batch": min_batch, "min_context": min_context, "batch": best["batch"],
            "context": best["context"], "fraction_of_copy": best["fraction_of_copy"],
            "target": KERNEL_TARGET, "met": met}


# -- engine ------------------------------------------------------------------------------------
def write_model_dir(shape: ModelShape, out: Path, tokenizer_dir: Path | None = None) -> Path:
    """config.json of `shape` plus the bundled model's tokenizer (or `tokenizer_dir`'s, where
    the bundled model is not installed): enough for dummy weights."""
    from baton.engine.models.loader import resolve_model_dir

    source = tokenizer_dir or resolve_model_dir(None)
    (out / "config.json").write_text(json.dumps(shape.config_json(), indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out / name)
    return out


def make_engine(args: argparse.Namespace, model_dir: Path, device: torch.device):
    from baton.engine.config import EngineConfig
    from baton.engine.core import EngineCore

    per_seq = -(-(args.prompt_len + args.max_tokens + 1) // args.block_size)
    max_batch = max(args.decode_batches)
    return EngineCore(EngineConfig.from_args(
        model=str(model_dir), load_format="dummy", dtype=args.dtype, device=device.type,
        block_size=args.block_size, max_num_seqs=max_batch,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
        num_kv_blocks=max_batch * per_seq + 16, attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager, seed=args.seed,
        async_scheduling=args.async_scheduling == "on"))  # `both` switches (set_scheduling)


def decode_throughput(engine, batch: int, prompt_len: int, max_tokens: int,
                      rng: np.random.Generator) -> dict:
    """Time the decode steps in which all `batch` requests run (see the module docstring)."""
    from baton.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    high = min(TOKENIZER_VOCAB, engine.model_config.vocab_size)
    reqs = []
    for i in range(batch):
        ids = rng.integers(FIRST_PROMPT_ID, high, size=prompt_len).tolist()
        reqs.append(engine.make_request(f"bench-{batch}-{i}", ids, params, detokenize=False))
        engine.add(reqs[-1])
    while any(r.num_output_tokens == r.num_pending for r in reqs):  # a token read, each
        engine.step()  # prefill, untimed
    for _ in range(DECODE_WARMUP_STEPS):
        engine.step()
    times = []
    timing = engine.timing.snapshot()
    while max(r.num_output_tokens for r in reqs) < max_tokens:  # every request decodes
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    device_s = engine.timing.device_s - timing.device_s
    busy_steps = engine.timing.steps - timing.steps
    while engine.has_unfinished_requests():
        engine.step()
    if not times:
        raise SystemExit(f"no full decode step at batch {batch}: raise --max-tokens "
                         f"(now {max_tokens}) or --max-num-batched-tokens")
    # Scheduling ahead, the engine times each step on the device (CUDA events); a synchronous
    # step's "device" time is only what the host waited, so it gives none.
    ahead = engine.async_scheduling
    return {"batch": batch, "steps": len(times), "step_ms_mean": 1e3 * statistics.mean(times),
            "step_ms_median": 1e3 * statistics.median(times),
            "output_tok_s": batch * len(times) / sum(times),
            "async_scheduling": "on" if ahead else "off",
            "device_busy": device_s / sum(times),
            "device_ms": 1e3 * device_s / busy_steps if ahead and busy_steps else None}


def weight_bytes(engine) -> int:
    """Bytes one decode step reads from the weights, a tied head counted once. On CPU the bf16
    linears are packed (our GEMM's layout or oneDNN's) outside `parameters()`; there the
    config's count is used."""
    from baton_cpu.linear import PackedLinear

    model = engine.runner.model
    if any(isinstance(m, PackedLinear) for m in model.modules()):
        return engine.model_config.num_params * torch.finfo(engine.runner.dtype).bits // 8
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(unique.values())


def weight_floor(engine, step_ms: float, batch: int, copy_gbps: float) -> dict:
    nbytes = weight_bytes(engine)
    floor_ms = 1e3 * nbytes / (copy_gbps * 1e9)
    ratio = step_ms / floor_ms
    met = ratio <= FLOOR_TARGET
    print(f"batch-{batch} decode step {step_ms:.3f} ms; weight-streaming floor "
          f"{nbytes / 1e9:.3f} GB / {copy_gbps:.1f} GB/s = {floor_ms:.3f} ms; ratio "
          f"{ratio:.2f}x (target <= {FLOOR_TARGET}x): {'met' if met else 'not met'}")
    return {"batch": batch, "step_ms": step_ms, "weight_bytes": nbytes, "floor_ms": floor_ms,
            "step_over_floor": ratio, "target": FLOOR_TARGET, "met": met}


def set_scheduling(engine, mode: str) -> None:
    """Switch the idle engine between synchronous steps and scheduling ahead (the flag
    `EngineCore.step` reads each step; nothing else holds it, and an idle engine has no step
    in flight)."""
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine switches scheduling modes only when idle")
    engine.async_scheduling = mode == "on"


def run_engine(args: argparse.Namespace, device: torch.device, shape: ModelShape,
               copy_gbps: float, on_row=lambda rows: None) -> dict:
    """`on_row(rows)` after each batch is measured (the caller saves what it has so far).
    With `--async-scheduling both` every batch runs synchronously, then every batch
    scheduled ahead; a row that fails is recorded as such and the run goes on."""
    modes = ("off", "on") if args.async_scheduling == "both" else (args.async_scheduling,)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    elem = torch.finfo(DTYPES[args.dtype]).bits // 8
    sim = with_shape(profile_for(name), shape, elem, elem)
    with tempfile.TemporaryDirectory(prefix="baton-gpu-bench-") as tmp:
        engine = make_engine(args, write_model_dir(shape, Path(tmp), args.tokenizer_dir), device)
    try:
        platform = engine.runner.platform
        backend = engine.runner.backend.name
        graphs = platform.name == "cuda" and platform.fast_decode is not None
        print(f"\nengine: {args.shape} shape ({shape.layers} layers, hidden "
              f"{shape.hidden_size}, {shape.num_heads} heads, {shape.num_kv_heads} KV heads, "
              f"vocab {shape.vocab_size}), {args.dtype} on {device.type}, random weights; "
              f"attention backend {backend}, CUDA graphs {'on' if graphs else 'off'}")
        print(f"prompt {args.prompt_len} tokens, {args.max_tokens} output tokens per request; "
              f"sim ms: the {sim.name} profile's model of the same step")
        print(f"{'batch':>7}{'steps':>7}{'ahead':>7}{'step ms':>10}{'out tok/s':>12}"
              f"{'busy':>7}{'sim ms':>9}")
        rng = np.random.default_rng(args.seed)
        rows: list[dict] = []
        for mode in modes:  # every synchronous row first: a mode that hangs keeps them
            for batch in args.decode_batches:
                rows.append(measure_row(engine, sim, args, batch, mode, rng))
                on_row(rows)
        timed = [r for r in rows if "error" not in r]
        if not timed:
            raise SystemExit("no decode batch could be measured: " + rows[0]["error"])
        smallest = min(timed, key=lambda r: r["batch"])
        floor = weight_floor(engine, smallest["step_ms_median"], smallest["batch"], copy_gbps)
        calibration = calibrate(sim, timed)
        print_calibration(calibration)
    finally:
        engine.close()
    return {"shape": dataclasses.asdict(shape), "dtype": args.dtype, "device": device.type,
            "attention_backend": backend, "cuda_graphs": graphs,
            "async_scheduling": args.async_scheduling,
            "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "batches": rows, "weight_floor": floor, "sim": calibration}


def measure_row(engine, sim, args: argparse.Namespace, batch: int, mode: str,
                rng: np.random.Generator) -> dict:
    """One batch in one scheduling mode, printed, with the profile's modelled step beside it;
    an error (a mode that fails on this device) becomes the row."""
    try:
        set_scheduling(engine, mode)
        row = decode_throughput(engine, batch, args.prompt_len, args.max_tokens, rng)
    except Exception as err:  # noqa: BLE001 - reported in the row; the next mode still runs
        print(f"{batch:>7}{'-':>7}{mode:>7}  failed: {type(err).__name__}: {err}")
        return {"batch": batch, "async_scheduling": mode,
                "error": f"{type(err).__name__}: {err}"[:2000]}
    contexts = decode_contexts(args.prompt_len, DECODE_WARMUP_STEPS + 1, row["steps"])
    sim_bytes, sim_flops = step_work(sim, batch, contexts)
    row.update(sim_ms=modelled_ms(sim, batch, contexts), sim_bytes=sim_bytes, sim_flops=sim_flops)
    row["measured_over_sim"] = row["step_ms_mean"] / row["sim_ms"]
    print(f"{batch:>7}{row['steps']:>7}{mode:>7}{row['step_ms_mean']:>10.3f}"
          f"{row['output_tok_s']:>12.1f}{row['device_busy']:>7.3f}{row['sim_ms']:>9.3f}")
    return row


def print_calibration(calibration: dict) -> None:
    now, fitted = calibration["profile_device"], calibration["fit"]
    print(f"sim profile {calibration['profile']}: {profile_numbers(now)}; ", end="")
    if fitted is None:
        print("no fit (it needs two batch sizes the roofline can describe)")
    else:
        print(f"fitted to these steps: {profile_numbers(fitted)} (worst residual "
              f"{100 * fitted['max_relative_residual']:.0f}%)")


def profile_numbers(device: dict) -> str:
    peak = device["peak_tflops"]
    return (f"memory_bandwidth_gbs {device['memory_bandwidth_gbs']:g}, peak_tflops "
            f"{'(no step bound by compute)' if peak is None else format(peak, 'g')}, "
            f"launch_us {device['launch_us']:g}")


# -- command line ------------------------------------------------------------------------------
def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of positive integers")
    return values


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("kernels", "engine", "all"))
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="default: cuda when available")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="llama3-8b")
    for field in SHAPE_OVERRIDES:
        ap.add_argument(f"--{field.replace('_', '-')}", type=int, default=None,
                        help=f"override the shape's {field}")
    ap.add_argument("--copy-mib", type=int, default=None,
                    help="copy buffer size (default 2048 on CUDA, 64 on CPU)")
    ap.add_argument("--repeats", type=int, default=10, help="timed copies (and CPU calls)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--block-size", type=int, choices=(8, 16, 32, 64), default=16,
                    help="tokens per KV block, in the kernels and the engine")
    k = ap.add_argument_group("kernels")
    k.add_argument("--batches", type=int_list, default=[1, 4, 16, 64, 256])
    k.add_argument("--contexts", type=int_list, default=[512, 2048, 8192, 32768])
    k.add_argument("--mem-limit-gib", type=float, default=None,
                   help="skip points whose KV exceeds this (default: 60%% of free CUDA "
                        "memory, 0.25 on CPU)")
    e = ap.add_argument_group("engine")
    e.add_argument("--decode-batches", type=int_list, default=[1, 32, 256])
    e.add_argument("--prompt-len", type=int, default=128)
    e.add_argument("--tokenizer-dir", type=Path, default=None,
                   help="a model folder with the bundled tokenizer (default: the bundled model)")
    e.add_argument("--max-tokens", type=int, default=None,
                   help="output tokens per request (default 128 on CUDA, 16 on CPU)")
    e.add_argument("--max-num-batched-tokens", type=int, default=8192)
    e.add_argument("--attention-backend", choices=("auto", "torch", "triton"), default="auto")
    e.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    e.add_argument("--async-scheduling", choices=("off", "on", "both"), default="both",
                   help="launch each step ahead of the host (runner/ahead.py): a step's "
                        "time is then the wall between steps, host work overlapped; both: "
                        "each batch synchronously, then ahead")
    return ap


def resolve_args(ap: argparse.ArgumentParser, argv: list[str] | None
                 ) -> tuple[argparse.Namespace, torch.device, ModelShape]:
    from baton_kernels._common import interpreting

    args = ap.parse_args(argv)
    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device is available")
    device = torch.device(name)
    if args.what != "engine" and device.type == "cpu" and not interpreting():
        ap.error("the kernels run on CPU only in Triton's interpreter: set TRITON_INTERPRET=1 "
                 "in the environment")
    overrides = {f: getattr(args, f) for f in SHAPE_OVERRIDES if getattr(args, f) is not None}
    shape = dataclasses.replace(SHAPES[args.shape], **overrides)
    if (min(dataclasses.asdict(shape).values()) < 1 or shape.num_heads % shape.num_kv_heads
            or shape.vocab_size <= FIRST_PROMPT_ID):
        ap.error(f"shape {shape} needs positive sizes, num_heads divisible by num_kv_heads "
                 f"and vocab_size > {FIRST_PROMPT_ID}")
    if args.copy_mib is None:
        args.copy_mib = 2048 if device.type == "cuda" else 64
    if args.max_tokens is None:
        args.max_tokens = 128 if device.type == "cuda" else 16
    if args.max_tokens < DECODE_WARMUP_STEPS + 2 or args.prompt_len < 1 or args.repeats < 1:
        ap.error(f"need --max-tokens >= {DECODE_WARMUP_STEPS + 2}, --prompt-len >= 1 and "
                 "--repeats >= 1")
    return args, device, shape


def header(device: torch.device) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}, triton {triton_version}")
    return {"name": name, "type": device.type, "torch": str(torch.__version__),
            "triton": triton_version}


def main(argv: list[str] | None = None) -> int:
    args, device, shape = resolve_args(build_parser(), argv)
    torch.manual_seed(args.seed)
    results: dict = {"device": header(device)}

    def save() -> None:  # after every part: a run stopped mid-way keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(results) + "\n")

    copy = measure_copy_bandwidth(device, args.copy_mib * MIB, args.repeats)
    release(device)  # the copy buffers, freed on return
    print(f"copy bandwidth: {args.copy_mib} MiB copied in {copy['best_s'] * 1e6:.1f} us "
          f"(best of {args.repeats}): {copy['gbps']:.1f} GB/s, read + write")
    results["copy"] = copy
    save()
    if args.what in ("kernels", "all"):
        results["kernels"] = run_kernels(args, device, shape, copy["gbps"])
        save()
    if args.what in ("engine", "all"):
        def partial(rows: list[dict]) -> None:
            results["engine"] = {"batches": rows, "partial": True}
            save()

        results["engine"] = run_engine(args, device, shape, copy["gbps"], partial)
        save()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
