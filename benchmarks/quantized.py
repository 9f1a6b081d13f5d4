"""Decode speed of the bundled model served quantized (issue 39): the GGUF's Q4_1 weights as
shipped, Q8_0 and a Q4_K_M mix (re-quantized from the same weights, `gguf_variants.py`)
through `--quantization auto`, against the bf16 de-quantized model (`--quantization none`),
at batch 1, 8 and 32, in one run.

    python -m benchmarks.quantized [--batches 1 8 32] [--repeats 2] [--threads N]

Decode tokens/s of a batch = batch x (long - short) / (t_long - t_short), two greedy
generations of the same prompts with `ignore_eos` that differ only in their length: the
prefill and the engine's fixed costs cancel. Prefill tokens/s: a 512-token prompt (new
each time: no prefix-cache hit) generating one token, the best of 3. Every configuration runs in this process, one
after the other per batch and repeat, so the ratios share whatever else the machine does.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

from baton.engine.models.loader import default_cache_dir
from benchmarks.gguf_variants import requantized_gguf

PROMPT = [1, 504, 3458, 282, 4649, 314]  # a few tokens (prefill is not what is measured)
SHORT, LONG = 8, 72
CPU_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "amx_int8")


def decode_tokens_per_s(llm, batch: int) -> float:
    from baton import SamplingParams

    def run(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([PROMPT] * batch, params, use_tqdm=False)
        return time.perf_counter() - t0

    run(SHORT)  # warm up this batch size
    return batch * (LONG - SHORT) / (run(LONG) - run(SHORT))


def prefill_tokens_per_s(llm, seed: int, tokens: int = 512, runs: int = 3) -> float:
    from baton import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1)
    best = float("inf")
    for i in range(runs + 1):  # the first warms up
        prompt = [(PROMPT[j % len(PROMPT)] + 7 * i + 31 * seed + j) % 30000 + 100
                  for j in range(tokens)]
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        best = min(best, time.perf_counter() - t0) if i else best
    return tokens / best


def cpu_flags() -> str:
    info = Path("/proc/cpuinfo")
    text = info.read_text() if info.exists() else ""
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                  if line.startswith("model name")), "unknown CPU")
    return f"{model}; {' '.join(f for f in CPU_FLAGS if f in flags) or 'none of ' + str(CPU_FLAGS)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = p.parse_args()
    from baton import LLM
    from baton_cpu.quant_linear import load_quant_kernels

    cache = default_cache_dir()
    native = load_quant_kernels(cache)
    print(f"CPU: {cpu_flags()}; quantized kernel path: "
          f"{native.isa if native else 'not built'}", flush=True)
    configs = {"bf16": (None, "none"), "Q4_1": (None, "auto"),
               "Q8_0": (str(requantized_gguf("Q8_0", cache)), "auto"),
               "Q4_K_M": (str(requantized_gguf("Q4_K_M", cache)), "auto")}
    engines = {name: LLM(model, quantization=q, num_threads=args.threads,
                         kv_cache_memory_bytes=256 << 20, max_num_seqs=max(args.batches))
               for name, (model, q) in configs.items()}
    for repeat in range(args.repeats):
        for batch in args.batches:
            rates = {}
            for name, llm in engines.items():
                gc.collect()
                rates[name] = decode_tokens_per_s(llm, batch)
            _report(f"repeat {repeat + 1} batch {batch:3d}", rates)
        _report(f"repeat {repeat + 1} prefill 512", {
            name: prefill_tokens_per_s(llm, repeat) for name, llm in engines.items()})


def _report(what: str, rates: dict[str, float]) -> None:
    base = rates["bf16"]
    print(f"{what}: " + "  ".join(f"{name} {r:7.1f} tok/s ({r / base:.2f}x)"
                                  for name, r in rates.items()), flush=True)


if __name__ == "__main__":
    main()
