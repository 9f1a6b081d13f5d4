"""Structured outputs benchmark: the grammar engine's per-step mask time at batch 1 and 64,
and offline throughput with half the requests constrained by a JSON schema against none.

    python -m benchmarks.structured_bench [--num-requests 64] [--max-tokens 64]
        [--dtype bfloat16] [--compare] [--out result.json]

Mask time: `--rows` matchers, each walking its own random path through a nested schema
(each step: one batched fill of every row's bitmask, then each row takes a random allowed
token), so rows sit in different states as in a real batch; the apply time is the
sampler's masking of 32 constrained rows of 64. `--compare` also times xgrammar when it is
installed (how the engine was chosen: `engine/structured/llguidance_backend.py`).

Throughput: the same prompts through one `LLM` (prefix cache off), the two runs
alternated `--rounds` times; every request makes exactly `--max-tokens` tokens
(unconstrained ones with ignore_eos, constrained ones, ignore_eos off, through a schema
longer than that), so the runs do the same model work and differ only by the grammar work.
Output tokens per second (best round of each), the constrained run's loss (target <= 15%),
and the grammar's own time per step in it (mask fill + apply + matchers taking tokens).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np
import torch

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string"},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "role", "address", "tags"],
}
# Longer than any --max-tokens we use: constrained requests run to the length cap.
LONG = {"type": "array", "minItems": 40,
        "items": {"type": "object", "required": ["id", "name", "ok"],
                  "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                                 "ok": {"type": "boolean"}}}}


def _allowed(row: torch.Tensor, vocab: int) -> np.ndarray:
    bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def time_llguidance(tokenizer, vocab: int, rows: int, steps: int, threads: int) -> float:
    """ms per step to fill `rows` bitmasks in one call, rows in their own states."""
    from baton.engine.structured.llguidance_backend import LLGuidanceBackend

    backend = LLGuidanceBackend(tokenizer, vocab, tokenizer.eos_token_id, threads)
    grammar = backend.compile("json_schema", json.dumps(NESTED))
    matchers = [grammar.matcher() for _ in range(rows)]
    bitmask = torch.empty(rows, -(-vocab // 32), dtype=torch.int32)
    return _walk(matchers, lambda ms: backend.fill_bitmask(ms, bitmask), bitmask, vocab,
                 steps, lambda m, t: m.accept(t), lambda m: m.is_terminated)


def time_xgrammar(tokenizer, vocab: int, rows: int, steps: int, threads: int) -> float | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info, max_threads=threads).compile_json_schema(
        json.dumps(NESTED), any_whitespace=False)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    bitmask = xgr.allocate_token_bitmask(rows, vocab)
    batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def fill(ms):
        if len(ms) == 1:
            ms[0].fill_next_token_bitmask(bitmask, 0)
        else:
            batch.batch_fill_next_token_bitmask(ms, bitmask)

    return _walk(matchers, fill, bitmask, vocab, steps, lambda m, t: m.accept_token(t),
                 lambda m: m.is_terminated())


def _walk(matchers, fill, bitmask, vocab, steps, accept, done) -> float:
    rng = random.Random(0)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fill(matchers)
        times.append(time.perf_counter() - t0)
        for i, m in enumerate(matchers):
            if done(m):
                continue
            ids = _allowed(bitmask[i], vocab)
            if not accept(m, int(ids[rng.randrange(len(ids))])):
                raise RuntimeError("a matcher rejected a token its own mask allowed")
    return 1e3 * statistics.mean(times)


def time_apply(vocab: int, rows: int = 64, constrained: int = 32, reps: int = 50) -> float:
    """Median ms to mask `constrained` of `rows` logits rows (the sampler's share)."""
    from baton.engine.structured.masks import GrammarMasks, apply_grammar_masks

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen)
    words = -(-vocab // 32)
    masks = GrammarMasks(list(range(0, rows, rows // constrained))[:constrained],
                         torch.randint(-2**31, 2**31 - 1, (constrained, words),
                                       dtype=torch.int32, generator=gen))
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        apply_grammar_masks(logits, masks)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[1:])


def throughput(llm, prompts: list[list[int]], max_tokens: int, constrained: bool
               ) -> tuple[float, float]:
    """(output tokens per second, seconds) for one pass; every other request constrained
    when `constrained`."""
    from baton import SamplingParams
    from baton.common.sampling_params import StructuredOutput

    long_schema = StructuredOutput("json_schema", json.dumps(LONG))
    params = []
    for i in range(len(prompts)):
        if constrained and i % 2 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=max_tokens,
                                         structured=long_schema))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=max_tokens,
                                         ignore_eos=True))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    made = sum(len(o.outputs[0].token_ids) for o in outs)
    if made != max_tokens * len(prompts):
        raise RuntimeError(f"expected {max_tokens * len(prompts)} tokens, got {made}")
    return made / elapsed, elapsed


class GrammarClock:
    """Seconds spent in the engine's grammar work (wraps the functions the runner and the
    sampler call), and the steps that had any."""

    def __init__(self) -> None:
        import baton.engine.runner.model_runner as runner
        import baton.engine.sampler as sampler

        self.seconds, self.steps = 0.0, 0
        for module, name in ((runner, "fill_grammar_masks"), (sampler, "apply_grammar_masks"),
                             (sampler, "accept_sampled")):
            setattr(module, name, self._timed(getattr(module, name), name == "fill_grammar_masks"))

    def _timed(self, fn, counts_step: bool):
        def timed(*args):
            t0 = time.perf_counter()
            out = fn(*args)
            self.seconds += time.perf_counter() - t0
            self.steps += counts_step and out is not None
            return out
        return timed


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=40, help="mask steps timed per batch size")
    ap.add_argument("--threads", type=int, default=None, help="mask threads (default: cores)")
    ap.add_argument("--compare", action="store_true", help="also time xgrammar, if installed")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from baton.engine.models.loader import resolve_model_dir
    from baton.engine.tokenizer import apply_chat_template, load_tokenizer

    tokenizer = load_tokenizer(resolve_model_dir(None))
    vocab = len(tokenizer)
    threads = args.threads or torch.get_num_threads()
    result: dict = {"vocab": vocab, "mask_threads": threads}
    for rows in (1, 64):
        result[f"llguidance_mask_ms_batch{rows}"] = time_llguidance(
            tokenizer, vocab, rows, args.steps, threads)
        if args.compare:
            result[f"xgrammar_mask_ms_batch{rows}"] = time_xgrammar(
                tokenizer, vocab, rows, args.steps, threads)
    result["apply_ms_32_of_64_rows"] = time_apply(vocab)
    if not args.skip_throughput:
        from baton import LLM, SamplingParams

        llm = LLM(dtype=args.dtype, max_num_seqs=args.num_requests,
                  enable_prefix_caching=False)
        llm.generate([[1, 2, 3, 4]] * 4, SamplingParams(max_tokens=4), use_tqdm=False)
        prompts = [apply_chat_template(tokenizer, [{"role": "user", "content":
                   f"List {i % 7 + 3} records of our users as JSON."}])
                   for i in range(args.num_requests)]
        throughput(llm, prompts[:8], 8, constrained=True)  # compile + warm the grammar
        clock = GrammarClock()
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for _ in range(args.rounds):
            for constrained in (False, True):
                runs[constrained].append(throughput(llm, prompts, args.max_tokens, constrained))
        (base, base_s), (mixed, mixed_s) = max(runs[False]), max(runs[True])
        result |= {"unconstrained_tok_s": base, "unconstrained_s": base_s,
                   "half_constrained_tok_s": mixed, "half_constrained_s": mixed_s,
                   "throughput_loss_pct": 100 * (1 - mixed / base),
                   "grammar_ms_per_step": 1e3 * clock.seconds / max(clock.steps, 1),
                   "step_ms_half_constrained": 1e3 * mixed_s * args.rounds / max(clock.steps, 1)}
    for key, value in result.items():
        shown = ("not installed" if value is None
                 else f"{value:.3f}" if isinstance(value, float) else value)
        print(f"{key:28s} {shown}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
