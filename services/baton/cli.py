"""`baton` command line: `baton generate` runs the engine on prompts (more subcommands come
with the services)."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from prompts with the local engine")
    gen.add_argument("prompts", nargs="+", help="prompt text (one request each)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message")
    gen.add_argument("--model", default=None, help="HF directory or .gguf (default: bundled)")
    gen.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "generate":
        return _generate(args)
    return 2


def _generate(args) -> int:
    from baton import LLM, SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                max_tokens=args.max_tokens)
    except ValueError as err:
        print(f"baton: {err}", file=sys.stderr)
        return 2
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
