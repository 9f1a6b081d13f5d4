"""Multi-LoRA serving's cost on the bundled model (issue 40): 8 random-weight rank-16 adapters
over every linear layer (`lora_adapters.py`), in one engine with `--max-loras 8`.

    python -m benchmarks.lora_bench [--batch 32] [--repeats 2] [--threads N]
    python -m benchmarks.lora_bench --serve [--streams 8] [--tokens 256]
        [--phase-seconds 10] [--rounds 2] [--threads N]

Decode tokens/s at the batch, as `quantized.py` measures it (two greedy generations of
the same prompts differing only in length; prefill and fixed costs cancel):
- `plain`: an engine without LoRA, base requests (the reference);
- `base`: the LoRA engine, base requests only (its one-call decode step still runs);
- `one`: every request of the batch with the same adapter;
- `mixed`: the 8 adapters, batch / 8 requests each, beside none of the base.
Then the time to load an adapter at run time (`AdapterRegistry.add`: read, checked, laid
out; median of 5), and `base` decode while another thread loads adapters back to back (how
much a load slows the running streams). Every configuration runs in this process, one after
the other per repeat, so the ratios share whatever else the machine does.

`--serve`: the same question through a `baton serve` worker, as inter-token latency of
streaming clients while others load and unload adapters over HTTP (`lora_serving.py`).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.lora_adapters import write_random_adapter
from benchmarks.quantized import cpu_flags

PROMPT = [1, 504, 3458, 282, 4649, 314]
SHORT, LONG = 8, 40
ADAPTERS = 8


def decode_tokens_per_s(llm, batch: int, loras) -> float:
    from baton import SamplingParams

    def run(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([PROMPT] * batch, params, use_tqdm=False, lora_request=loras)
        return time.perf_counter() - t0

    run(SHORT)  # warm up this batch and its adapters
    return batch * (LONG - SHORT) / (run(LONG) - run(SHORT))


def load_seconds(registry, path: Path, runs: int = 5) -> float:
    times = []
    for i in range(runs):
        t0 = time.perf_counter()
        registry.add(f"load-{i}", str(path))
        times.append(time.perf_counter() - t0)
        registry.remove(f"load-{i}")
    return statistics.median(times)


def decode_while_loading(llm, batch: int, path: Path) -> tuple[float, int]:
    """`base` decode tokens/s while a thread loads and unloads adapters without pause; and
    how many loads it made meanwhile."""
    stop, loads = threading.Event(), [0]

    def loader() -> None:
        while not stop.is_set():
            llm.lora_registry.add("busy", str(path))
            llm.lora_registry.remove("busy")
            loads[0] += 1

    thread = threading.Thread(target=loader)
    thread.start()
    try:
        rate = decode_tokens_per_s(llm, batch, None)
    finally:
        stop.set()
        thread.join()
    return rate, loads[0]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--serve", action="store_true",
                   help="instead: run-time loads against streams of a `baton serve` worker "
                        "(lora_serving.py)")
    p.add_argument("--streams", type=int, default=8, help="--serve: concurrent streams")
    p.add_argument("--tokens", type=int, default=256, help="--serve: tokens per response")
    p.add_argument("--phase-seconds", type=float, default=10.0,
                   help="--serve: length of each quiet and each loading window")
    p.add_argument("--rounds", type=int, default=2,
                   help="--serve: windows of each phase (alternating)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    from baton import LLM
    from baton.engine.models.loader import resolve_model_dir

    base_dir = resolve_model_dir(None)
    tmp = Path(tempfile.mkdtemp(prefix="lora_bench_"))
    paths = [write_random_adapter(base_dir, tmp / f"a{i}", seed=i, r=16)
             for i in range(2 if args.serve else ADAPTERS)]
    print(f"CPU: {cpu_flags()}", flush=True)
    if args.serve:
        from benchmarks.lora_serving import run

        try:
            run(args, paths, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    common = dict(num_threads=args.threads, kv_cache_memory_bytes=256 << 20,
                  max_num_seqs=args.batch)
    plain = LLM(**common)
    lora = LLM(max_loras=ADAPTERS, max_lora_rank=16,
               lora_modules=[f"a{i}={path}" for i, path in enumerate(paths)], **common)
    runs = {"plain": (plain, None), "base": (lora, None), "one": (lora, "a0"),
            "mixed": (lora, [f"a{i % ADAPTERS}" for i in range(args.batch)])}
    for repeat in range(args.repeats):
        rates = {}
        for name, (llm, loras) in runs.items():
            gc.collect()
            rates[name] = decode_tokens_per_s(llm, args.batch, loras)
        print(f"repeat {repeat + 1} batch {args.batch}: " + "  ".join(
            f"{name} {r:6.1f} tok/s ({r / rates['plain']:.2f}x)" for name, r in rates.items()),
            flush=True)
    print(f"run-time load of a rank-16 adapter over all linears: "
          f"{load_seconds(lora.lora_registry, paths[0]):.3f} s (median of 5)", flush=True)
    before = decode_tokens_per_s(lora, args.batch, None)
    during, loads = decode_while_loading(lora, args.batch, paths[1])
    print(f"base decode at batch {args.batch}: {before:.1f} tok/s alone, {during:.1f} tok/s "
          f"({during / before:.2f}x) while {loads} adapters were loaded on a thread", flush=True)


if __name__ == "__main__":
    main()
