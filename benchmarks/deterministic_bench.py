"""What deterministic mode (`--deterministic`) costs and what it buys, on the bundled model in
bf16, both modes in one run: prefill tokens/s (long prompts), decode tokens/s at batch 1, 8
and 32, offline throughput on the seeded chat workload; and exactness — how many resumed
streams (prompt plus the first k tokens sent, prefilled again) go on with other tokens than
the undisturbed run, and how many requests decode differently alone than in a batch.

    python -m benchmarks.deterministic_bench [--num-requests 32] [--out result.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from baton_loadtest.workload import chat_workload, corpus_token_ids

MODES = {"default": False, "deterministic": True}
RESUME_AT = (1, 7, 30)


def _llm(deterministic: bool):
    from baton import LLM

    gc.collect()  # the previous engine's KV cache first
    return LLM(dtype="bfloat16", deterministic=deterministic, num_kv_blocks=2048)


def _timed(llm, prompts, params) -> tuple[float, list]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, outs


def _prompts(llm, count: int, length: int) -> list[dict]:
    """`count` token-id prompts of `length` tokens from different places of the corpus."""
    corpus = corpus_token_ids(llm.get_tokenizer())
    step = (len(corpus) - length) // count
    return [{"prompt_token_ids": corpus[i * step:i * step + length]} for i in range(count)]


def _speed(llm, num_requests: int) -> dict[str, float]:
    from baton import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    long_prompts = _prompts(llm, 8, 700)
    llm.generate(long_prompts[:1], one, use_tqdm=False)  # warm up
    elapsed, outs = _timed(llm, long_prompts, one)
    out = {"prefill_tok_s": sum(len(o.prompt_token_ids) for o in outs) / elapsed}
    for batch in (1, 8, 32):
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        llm.generate(["Hi"] * batch, SamplingParams(max_tokens=1), use_tqdm=False)
        t_short, _ = _timed(llm, ["Hi"] * batch, SamplingParams(max_tokens=1))
        elapsed, _ = _timed(llm, ["Hi"] * batch, params)
        out[f"decode_b{batch}_tok_s"] = batch * 63 / max(elapsed - t_short, 1e-9)
    reqs = chat_workload(llm.get_tokenizer(), num_requests, seed=0)
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
              for r in reqs]
    elapsed, outs = _timed(llm, [r.prompt_token_ids for r in reqs], params)
    tokens = sum(len(r.prompt_token_ids) + r.max_tokens for r in reqs)
    out["chat_tok_s"] = tokens / elapsed
    return out


def _exactness(llm) -> dict[str, int]:
    from baton import SamplingParams

    texts = [p for i, p in enumerate(_prompts(llm, 12, 400)) if i % 2] + _prompts(llm, 6, 90)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    alone = [llm.generate(t, params, use_tqdm=False)[0] for t in texts]
    batch = llm.generate(texts, params, use_tqdm=False)
    batch_diffs = sum(a.outputs[0].token_ids != b.outputs[0].token_ids
                      for a, b in zip(alone, batch))
    resume_diffs = 0
    for k in RESUME_AT:
        rest = SamplingParams(temperature=0, max_tokens=48 - k, ignore_eos=True)
        resumed = llm.generate(
            [{"prompt_token_ids": list(a.prompt_token_ids) + list(a.outputs[0].token_ids[:k])}
             for a in alone], rest, use_tqdm=False)
        resume_diffs += sum(list(r.outputs[0].token_ids) != list(a.outputs[0].token_ids[k:])
                            for a, r in zip(alone, resumed))
    return {"streams": len(texts), "resumes": len(texts) * len(RESUME_AT),
            "resume_mismatches": resume_diffs, "batch_vs_alone_mismatches": batch_diffs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    print(f"CPU: {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
    result = {}
    for name, deterministic in MODES.items():
        llm = _llm(deterministic)
        result[name] = {**_speed(llm, args.num_requests), **_exactness(llm)}
        del llm
        print(name, json.dumps(result[name]))
    base, det = result["default"], result["deterministic"]
    for key in base:
        if key.endswith("tok_s"):
            print(f"{key:>20}: default {base[key]:9.1f}  deterministic {det[key]:9.1f}  "
                  f"ratio {det[key] / base[key]:.2f}x")
    for key in ("resume_mismatches", "batch_vs_alone_mismatches"):
        print(f"{key:>26}: default {base[key]}  deterministic {det[key]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
