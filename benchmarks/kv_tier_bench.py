"""The host offload tier on multi-turn conversations (issue 36): TTFT of turns >= 2 and
prompt tokens prefilled, with and without `--kv-offload-gib`, at the same device pool.

    python -m benchmarks.kv_tier_bench [--sessions 8] [--turns 6] [--offload-gib 2]
        [--disk-host-gib 0.05] [--out result.json]

The conversations are `loadtest/workloads/multi_turn.yaml`'s (each turn adds the recorded
answer and a new user message, 150-400 tokens), cut to `--sessions` x `--turns`. Each turn is
the token ids of the previous turn plus its new messages, so every turn's prompt extends the
last one's exactly. Turns go round-robin over the sessions, one request at a time: between
two turns of a session every other session sends one, and the device pool (a quarter of the
sessions' working set unless `--num-kv-blocks`) has evicted the session's prefix by then —
the think time the workload describes, without concurrency, so a turn's TTFT is its own
prefill (and the tier's load) alone. Both engines must answer every turn with the same
greedy tokens.

With `--disk-host-gib` > 0 a third engine runs the disk tier: a host tier of that size (well
under the working set) over a disk tier in a temporary directory, so most hits are read back
from disk.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

BLOCK = 16
WORKLOAD = "loadtest/workloads/multi_turn.yaml"


@dataclass
class RunResult:
    ttft_s: list[float]  # turns >= 2, in send order
    prefill_tokens: int  # prompt tokens the engine computed, every turn
    cached_tokens: int  # prompt tokens served from a cache, every turn
    tokens: list[list[int]]  # each turn's greedy output
    disk_read_blocks: int = 0  # blocks the disk tier read back
    disk_spills_dropped: int = 0  # evicted blocks its full write queue turned away
    # each schedule()'s seconds: the engine thread's time outside the forward, where the
    # tier's loads (and, before its worker thread, its disk I/O) run and stall every request
    schedule_s: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        ms = sorted(t * 1e3 for t in self.schedule_s)
        return {"ttft_p50_s": statistics.median(self.ttft_s),
                "ttft_mean_s": statistics.fmean(self.ttft_s),
                "prefill_tokens": self.prefill_tokens, "cached_tokens": self.cached_tokens,
                "disk_read_blocks": self.disk_read_blocks,
                "disk_spills_dropped": self.disk_spills_dropped,
                "schedule_max_ms": ms[-1], "schedule_p99_ms": ms[int(0.99 * (len(ms) - 1))]}


def conversations(tokenizer, sessions: int, turns: int) -> list[list[list[int]]]:
    """Each session's turns as token ids, each turn extending the one before."""
    from baton_loadtest.generator import RequestFactory
    from baton_loadtest.spec import WorkloadSpec

    spec = WorkloadSpec.load(WORKLOAD)
    spec = replace(spec, sessions=replace(spec.sessions, count=sessions, turns=turns))
    factory = RequestFactory(spec, tokenizer)
    out = []
    for s in range(sessions):
        ids: list[int] = []
        seen = 0
        session = []
        for turn in factory.session(s, 0):
            for m in turn.messages[seen:]:
                ids = ids + tokenizer.encode(m["content"] + "\n\n")
            seen = len(turn.messages)
            session.append(list(ids))
        out.append(session)
    return out


def run(convs: list[list[list[int]]], max_tokens: int, **engine_args) -> RunResult:
    """Every turn, round-robin over sessions, one at a time; TTFT from `add` to the
    request's first token."""
    from baton import SamplingParams
    from baton.engine.config import EngineConfig
    from baton.engine.core import EngineCore

    gc.collect()
    core = EngineCore(EngineConfig.from_args(**engine_args))
    result = RunResult([], 0, 0, [])
    schedule = core.scheduler.schedule

    def timed_schedule():
        t0 = time.perf_counter()
        out = schedule()
        result.schedule_s.append(time.perf_counter() - t0)
        return out

    core.scheduler.schedule = timed_schedule  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    before = core.stats.prompt_tokens_total
    for t in range(len(convs[0])):
        for s, session in enumerate(convs):
            rid = f"s{s}-t{t}"
            t0 = time.perf_counter()
            outs = core.add(core.make_request(rid, session[t], params))
            first = None
            tokens: list[int] = []
            while core.has_unfinished_requests() or core.needs_polling:
                time.sleep(core.idle_for())  # only loads in flight: poll, do not spin
                for o in core.step():
                    if first is None and o.new_token_ids:
                        first = time.perf_counter() - t0
                    tokens += o.new_token_ids
                    result.cached_tokens += o.num_cached_tokens if o.finished else 0
            assert first is not None and not outs
            if t >= 1:
                result.ttft_s.append(first)
            result.tokens.append(tokens)
    result.prefill_tokens = core.stats.prompt_tokens_total - before
    tier = core.metrics_snapshot().kv_tier
    if tier is not None:
        result.disk_read_blocks = tier.disk_read_blocks_total
        result.disk_spills_dropped = tier.disk_spills_dropped_total
    core.check_integrity()
    core.close()
    return result


def cpu_model() -> str:
    """The CPU's model name (Linux), else the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8, help="output tokens per turn")
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="device pool (default: a quarter of the working set)")
    ap.add_argument("--offload-gib", type=float, default=2.0)
    ap.add_argument("--disk-host-gib", type=float, default=0.05,
                    help="host tier over a disk tier, third run (0: no disk run)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from baton.engine.models.loader import resolve_model_dir
    from baton.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_dir(None))
    convs = conversations(tokenizer, args.sessions, args.turns)
    working_set = sum(len(s[-1]) + args.max_tokens for s in convs)
    longest = max(len(s[-1]) for s in convs) + args.max_tokens
    blocks = args.num_kv_blocks or max(working_set // 4, longest) // BLOCK + 1
    engine = dict(dtype=args.dtype, num_kv_blocks=blocks, block_size=BLOCK,
                  num_threads=args.num_threads, max_model_len=blocks * BLOCK)
    plain = run(convs, args.max_tokens, **engine)
    tier = run(convs, args.max_tokens, **engine, kv_offload_gib=args.offload_gib)
    report = {
        "cpu": cpu_model(), "sessions": args.sessions,
        "turns": args.turns, "working_set_tokens": working_set, "device_blocks": blocks,
        "offload_gib": args.offload_gib, "without_tier": plain.summary(),
        "with_tier": tier.summary(), "same_tokens": plain.tokens == tier.tokens,
        "ttft_p50_speedup": plain.summary()["ttft_p50_s"] / tier.summary()["ttft_p50_s"],
        "prefill_tokens_saved": 1 - tier.prefill_tokens / plain.prefill_tokens}
    if args.disk_host_gib > 0:
        with tempfile.TemporaryDirectory(prefix="kv-tier-bench-") as disk_dir:
            disk = run(convs, args.max_tokens, **engine, kv_offload_gib=args.disk_host_gib,
                       kv_disk_dir=disk_dir, kv_disk_gib=args.offload_gib)
        report |= {"with_disk_tier": disk.summary(), "disk_host_gib": args.disk_host_gib,
                   "disk_same_tokens": plain.tokens == disk.tokens,
                   "disk_ttft_p50_speedup": plain.summary()["ttft_p50_s"]
                   / disk.summary()["ttft_p50_s"]}
    print(json.dumps(report, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
