"""FP8 KV cache vs the model's dtype on the bundled model: KV blocks per GiB, greedy agreement
(the first position where each parity prompt's tokens differ), and offline throughput.

    python -m benchmarks.fp8_kv_bench [--kv-cache-dtype fp8] [--prompts 32]
        [--max-tokens 64] [--parity-tokens 48] [--out result.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import time

from baton import LLM, SamplingParams

PARITY_PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.", "def fibonacci(n):",
    "List three prime numbers greater than 100.", "Translate 'good morning' into Spanish.",
    "Why is the sky blue?", "Give me a short recipe for pancakes.",
]
_GIB = 1 << 30


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where the two token lists differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    return [o.outputs[0].token_ids for o in llm.chat(chats, params, use_tqdm=False)]


def throughput(llm: LLM, prompts: int, max_tokens: int) -> float:
    """Generated tokens per second for `prompts` chat prompts x `max_tokens` each."""
    chats = [[{"role": "user", "content": f"Tell me a story about the number {i}."}]
             for i in range(prompts)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.chat(chats[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    t0 = time.perf_counter()
    outs = llm.chat(chats, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def measure(kv_cache_dtype: str, args) -> dict:
    llm = LLM(dtype=args.dtype, kv_cache_dtype=kv_cache_dtype, max_num_seqs=args.prompts)
    runner = llm.engine.runner
    result = {"kv_dtype": str(runner.kv_cache.dtype).removeprefix("torch."),
              "bytes_per_block": runner.bytes_per_block,
              "blocks_per_gib": _GIB // runner.bytes_per_block,
              "native_decode_step": runner.platform.fast_decode is not None,
              "tokens": greedy(llm, PARITY_PROMPTS, args.parity_tokens),
              "tokens_per_s": round(throughput(llm, args.prompts, args.max_tokens), 1)}
    del llm, runner
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-cache-dtype", default="fp8")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--parity-tokens", type=int, default=48)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    base, fp8 = measure("auto", args), measure(args.kv_cache_dtype, args)
    report = {
        "blocks_per_gib": {base["kv_dtype"]: base["blocks_per_gib"],
                           fp8["kv_dtype"]: fp8["blocks_per_gib"]},
        "first_divergence": [first_divergence(a, b)
                             for a, b in zip(base["tokens"], fp8["tokens"])],
        "parity_tokens": args.parity_tokens,
        "tokens_per_s": {base["kv_dtype"]: base["tokens_per_s"],
                         fp8["kv_dtype"]: fp8["tokens_per_s"]},
        "throughput_ratio": round(fp8["tokens_per_s"] / base["tokens_per_s"], 3),
        "native_decode_step": {base["kv_dtype"]: base["native_decode_step"],
                               fp8["kv_dtype"]: fp8["native_decode_step"]},
    }
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
