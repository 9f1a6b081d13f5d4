"""Tensor parallelism's step time against one rank, on the same machine in one run: a
Llama-shaped model with random weights (`load_format="dummy"`), decode steps at batch 1 and
16 after a 64-token prompt, TP=1 with all cores against TP=2 with half the cores a rank.

    python -m benchmarks.tp_bench [--hidden 1024] [--layers 8] [--dtype float32]
        [--sizes 1 2] [--out result.json]

On CPU both ranks share the machine's memory bandwidth, so TP mostly adds the all-reduces'
cost; on GPUs each rank streams its own weights, which is what TP is for.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from baton import SamplingParams
from baton.engine.config import EngineConfig
from baton.engine.core import EngineCore


def make_model(path: Path, hidden: int, layers: int) -> None:
    import transformers

    from baton.engine.models.loader import resolve_model_dir

    heads = hidden // 64
    transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden,
                             intermediate_size=hidden * 11 // 4, num_hidden_layers=layers, num_attention_heads=heads,
                             num_key_value_heads=max(2, heads // 2),
                             max_position_embeddings=2048).save_pretrained(path)
    bundled = resolve_model_dir(None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled / name, path / name)


def step_times(model: Path, tp: int, dtype: str, batches=(1, 16), steps: int = 20) -> dict:
    """Mean decode step time (ms) per batch size at tensor-parallel size `tp`."""
    cores = os.cpu_count() or 2
    core = EngineCore(EngineConfig.from_args(
        model=str(model), load_format="dummy", dtype=dtype, tensor_parallel_size=tp,
        num_threads=max(1, cores // tp), num_kv_blocks=512))
    out = {}
    try:
        for bs in batches:
            for i in range(bs):
                core.add_request(f"{bs}-{i}", list(range(10, 74)),
                                 SamplingParams(max_tokens=steps + 8, ignore_eos=True))
            for _ in range(4):  # the prefill, then warm decode steps
                core.step()
            t0 = time.perf_counter()
            for _ in range(steps):
                core.step()
            out[bs] = round((time.perf_counter() - t0) / steps * 1000, 2)
            while core.has_unfinished_requests():
                core.step()
    finally:
        core.close()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp), args.hidden, args.layers)
        result = {"hidden": args.hidden, "layers": args.layers, "dtype": args.dtype,
                  "cores": os.cpu_count(),
                  "ms_per_step": {tp: step_times(Path(tmp), tp, args.dtype) for tp in args.sizes}}
    base = result["ms_per_step"][args.sizes[0]]
    for tp, times in result["ms_per_step"].items():
        for bs, ms in times.items():
            ratio = ms / base[bs]
            print(f"TP={tp} decode batch {bs}: {ms} ms/step ({ratio:.2f}x TP={args.sizes[0]})")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
