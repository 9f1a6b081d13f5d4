"""GPU benchmark (issue 39): an 8B-shaped decode step's linears in bf16, W4A16 and FP8.

    python -m benchmarks.gpu_quant_bench [--batches 1,16] [--layers 32] [--repeats 20]
        [--formats bf16,w4a16,...] [--json PATH]

A step is the four linears of every layer of Llama-3-8B: fused q/k/v (N 6144, K 4096), o
(4096 x 4096), fused gate/up (28672 x 4096) and down (4096 x 14336); each layer has weights of
its own (random, seeded), so a step streams every weight from memory as decode does, none
from L2. The step's calls are captured in one CUDA graph (the engine replays decode steps as
graphs: no launch gaps) and replayed; its time is the median of `--repeats` replays (CUDA
events). Formats (`FORMATS`): bf16 (``F.linear``, cuBLAS); int4 g128 and int8 per-channel
weights (`baton_kernels.int_weight_gemm`); FP8 per-channel with dynamic per-token activations
and FP8 128x128 blocks (`baton_kernels.fp8_weight_gemm`: ``torch._scaled_mm`` / the Triton
W8A8 GEMM on sm_89+), and FP8 through the W8A16 path an sm_80 GPU takes. Each row: step ms,
its ratio to bf16 (the issue asks FP8 <= 0.6 at batch 1), the weight bytes a step reads and
the rate that makes, against the device's read bandwidth from the same run.

Without CUDA (``TRITON_INTERPRET=1``; ``--shape tiny``) the same calls run eagerly on CPU, FP8
as an sm_90 would route it: a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.timing import measure_read_bandwidth, release, time_calls

GIB = 1 << 30
SHAPES = {  # name -> (hidden, intermediate, q/k/v width, layers)
    "llama3-8b": (4096, 14336, 6144, 32),
    "tiny": (128, 256, 192, 2),
}
FORMATS = ("bf16", "w4a16_g128", "w8a16_int8", "fp8_channel", "fp8_block", "fp8_w8a16")
TARGET_FP8_RATIO = 0.6


def layer_shapes(shape: str) -> list[tuple[int, int]]:
    """(N, K) of one layer's linears: q/k/v, o, gate/up, down."""
    hidden, inter, qkv, _ = SHAPES[shape]
    return [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]


def make_linear(fmt: str, n: int, k: int, device: torch.device, gen: torch.Generator
                ) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    """(y = f(x), the bytes of weight and scales it reads) of one random weight."""
    from baton_kernels import int_weight_gemm

    if fmt == "bf16":
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        return (lambda x: torch.nn.functional.linear(x, w)), w.numel() * 2
    if fmt in ("w4a16_g128", "w8a16_int8"):
        bits, group = (4, 128) if fmt == "w4a16_g128" else (8, k)
        packed = torch.randint(-2**31, 2**31 - 1, (k * bits // 32, n), device=device,
                               dtype=torch.int32, generator=gen)  # random codes
        scales = (torch.rand(-(-k // group), n, device=device, generator=gen) * 1e-3).to(
            torch.bfloat16).t()                                  # group-major [N, G]
        return ((lambda x: int_weight_gemm(x, packed, scales, None, None, group, bits, n, k)),
                packed.numel() * 4 + scales.numel() * 2)
    w = (torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 40).to(
        torch.float8_e4m3fn)
    block = (128, 128) if fmt == "fp8_block" else None
    shape = (-(-n // 128), -(-k // 128)) if block else (n,)
    w_scale = torch.rand(shape, device=device, generator=gen) * 1e-4
    capability = ((8, 0) if fmt == "fp8_w8a16"
                  else torch.cuda.get_device_capability(device) if device.type == "cuda"
                  else (9, 0))

    def call(x):
        from baton_kernels.fp8_gemm import fp8_gemm_for

        return fp8_gemm_for(capability, x, w, w_scale, block)
    return call, w.numel() + w_scale.numel() * 4


def build_step(fmt: str, shape: str, layers: int, device: torch.device, seed: int
               ) -> tuple[list[tuple[Callable, int]], int]:
    """Every layer's linears (with their K: the input width), and the bytes a step reads."""
    gen = torch.Generator(device=device).manual_seed(seed)
    calls, total = [], 0
    for _ in range(layers):
        for n, k in layer_shapes(shape):
            fn, nbytes = make_linear(fmt, n, k, device, gen)
            calls.append((fn, k))
            total += nbytes
    return calls, total


def time_step(calls: list[tuple[Callable, int]], batch: int, device: torch.device,
              repeats: int) -> float:
    """Median seconds of one step (every call once) at `batch` rows: a CUDA graph replay
    on CUDA, eager calls elsewhere."""
    inputs = {k: torch.randn(batch, k, device=device).to(torch.bfloat16) for _, k in calls}

    def step():
        for fn, k in calls:
            fn(inputs[k])
    step()  # compiles the kernels (and warms cuBLAS) before any capture
    if device.type != "cuda":
        return statistics.median(time_calls(step, device, repeats, warmup=0))
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = time_calls(graph.replay, device, repeats, warmup=2)
    del graph
    return statistics.median(times)


def run(args: argparse.Namespace, device: torch.device, save: Callable[[dict], None]
        ) -> dict:
    results: dict = {"shape": args.shape, "layers": args.layers, "formats": {}}
    read = measure_read_bandwidth(device, (2 * GIB) if device.type == "cuda" else 1 << 24,
                                  args.repeats)
    release(device)
    results["read_gbps"] = round(read["gbps"], 1)
    print(f"read bandwidth: {read['gbps']:.1f} GB/s")
    print(f"{'format':<12} {'batch':>5} {'step ms':>9} {'vs bf16':>8} {'GB read':>8} "
          f"{'GB/s':>8}")
    for fmt in args.formats:
        calls, nbytes = build_step(fmt, args.shape, args.layers, device, args.seed)
        rows = []
        for batch in args.batches:
            seconds = time_step(calls, batch, device, args.repeats)
            bf16 = results["formats"].get("bf16", {}).get(str(batch))
            row = {"batch": batch, "step_ms": round(seconds * 1e3, 4), "weight_bytes": nbytes,
                   "gbps": round(nbytes / seconds / 1e9, 1),
                   "vs_bf16": round(seconds * 1e3 / bf16["step_ms"], 3) if bf16 else None}
            rows.append(row)
            print(f"{fmt:<12} {batch:>5} {row['step_ms']:>9.3f} "
                  f"{row['vs_bf16'] if row['vs_bf16'] is not None else '-':>8} "
                  f"{nbytes / 1e9:>8.2f} {row['gbps']:>8.1f}", flush=True)
        results["formats"][fmt] = {str(r["batch"]): r for r in rows}
        del calls
        release(device)
        save(results)
    fp8 = results["formats"].get("fp8_channel", {}).get("1", {}).get("vs_bf16")
    if fp8 is not None:
        results["fp8_batch1_vs_bf16"] = fp8
        results["fp8_target_met"] = fp8 <= TARGET_FP8_RATIO
    return results


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="llama3-8b on CUDA, tiny elsewhere (default)")
    ap.add_argument("--layers", type=int, default=None, help="default: the shape's")
    ap.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")],
                    default=[1, 16])
    ap.add_argument("--formats", type=lambda s: s.split(","), default=list(FORMATS))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the results here too")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        from baton_kernels._common import interpreting

        if not interpreting():
            ap.error("no CUDA device: set TRITON_INTERPRET=1 to run the kernels on CPU")
    args.shape = args.shape or ("llama3-8b" if device.type == "cuda" else "tiny")
    args.layers = args.layers or SHAPES[args.shape][3]
    if unknown := set(args.formats) - set(FORMATS):
        ap.error(f"unknown formats {sorted(unknown)}; the formats: {', '.join(FORMATS)}")
    if "bf16" in args.formats:  # first: the others are compared with it
        args.formats = ["bf16"] + [f for f in args.formats if f != "bf16"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}, shape {args.shape} x {args.layers} "
          "layers")

    def save(results: dict) -> None:  # after every format: a cut-off run keeps its rows
        if args.json:
            args.json.write_text(json.dumps({"device": name, **results}) + "\n")

    results = {"device": name, **run(args, device, save)}
    save(results)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
