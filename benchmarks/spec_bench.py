"""Speculative decoding (n-gram prompt lookup) against plain decoding, on the bundled model,
both in one run: output tokens/s at batch 1, 8 (and more with --batches) on the
input-grounded workload (`baton_loadtest.grounded`) and on the chat mix, greedy, with the
count of requests whose tokens differ (must be 0), the acceptance rate and mean accepted
run per verify step.

    python -m benchmarks.spec_bench [--requests 16] [--batches 1,8] [--k 4]
        [--method ngram|suffix] [--dtype bfloat16] [--deterministic]
        [--disable-by-batch-size N] [--out result.json]

In the default mode a request's tokens can differ between the two engines at a near-tie
when other requests' prompts are chunked differently (the same holds between two runs
without speculation); with --deterministic they may not differ at all.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from baton_loadtest.grounded import grounded_workload
from baton_loadtest.workload import chat_workload


def _engine(spec: dict | None, dtype: str, deterministic: bool = False):
    from baton import LLM

    args: dict = {"dtype": dtype, "num_kv_blocks": 4096, "deterministic": deterministic}
    if spec is not None:
        args["speculative_config"] = json.dumps(spec)
    return LLM(**args)


def _prompts(llm, workload: str, n: int) -> tuple[list, list[int]]:
    """Token-id prompts and max_tokens of `n` requests of `workload`."""
    tok = llm.get_tokenizer()
    if workload == "grounded":
        reqs = grounded_workload(n, seed=1)
        texts = [tok.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=False)
                 for r in reqs]
        return ([{"prompt_token_ids": tok.encode(t, add_special_tokens=False)} for t in texts],
                [r.max_tokens for r in reqs])
    chat = chat_workload(tok, n, seed=1)
    return ([{"prompt_token_ids": r.prompt_token_ids} for r in chat],
            [r.max_tokens for r in chat])


def _run(llm, prompts: list, max_tokens: list[int], batch: int) -> tuple[float, list]:
    """Seconds for all requests, `batch` at a time, and their outputs."""
    from baton import SamplingParams

    outs, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        params = [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens[i:i + batch]]
        outs += llm.generate(prompts[i:i + batch], params, use_tqdm=False)
    return time.perf_counter() - t0, outs


def _acceptance(llm) -> dict[str, float]:
    c = llm.engine.speculator.counters
    if not c.proposed_tokens:
        return {}
    return {"acceptance": c.accepted_tokens / c.proposed_tokens,
            "mean_accepted": c.accepted_tokens / max(1, c.verified_requests)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--method", default="ngram")
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="speculation's own cut-off (default: the largest batch, so every "
                             "point speculates; 4 is the engine's default)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="alternating runs of each engine per point; the best counts")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--deterministic", action="store_true",
                        help="both engines batch-invariant: greedy tokens must then match")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print(f"CPU: {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"{args.dtype}, k={args.k}, {args.method}")
    spec = {"method": args.method, "num_speculative_tokens": args.k,
            "disable_by_batch_size": args.disable_by_batch_size or max(batches)}
    # both engines side by side, runs alternating: a load that comes and goes on a shared
    # machine hits both
    engines = {"plain": _engine(None, args.dtype, args.deterministic),
               "spec": _engine(spec, args.dtype, args.deterministic)}
    for llm in engines.values():
        llm.generate(["warm up"], use_tqdm=False)
    result: dict = {}
    for workload in ("grounded", "chat"):
        prompts, max_tokens = _prompts(engines["plain"], workload, args.requests)
        for batch in batches:
            key = f"{workload}_b{batch}"
            point: dict = {"plain": 0.0, "spec": 0.0}
            tokens = {}
            for _ in range(args.repeats):
                for name, llm in engines.items():
                    elapsed, outs = _run(llm, prompts, max_tokens, batch)
                    n = sum(len(o.outputs[0].token_ids) for o in outs)
                    point[name] = max(point[name], n / elapsed)
                    tokens[name] = [o.outputs[0].token_ids for o in outs]
            point["ratio"] = point["spec"] / point["plain"]
            point["mismatches"] = sum(a != b for a, b in zip(tokens["plain"], tokens["spec"]))
            result[key] = point
            print(f"{key:>12}: plain {point['plain']:7.1f} tok/s  {args.method} "
                  f"{point['spec']:7.1f} tok/s  ratio {point['ratio']:.2f}x  mismatched "
                  f"requests {point['mismatches']}", flush=True)
    result["acceptance"] = _acceptance(engines["spec"])
    print("acceptance:", json.dumps(result["acceptance"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
