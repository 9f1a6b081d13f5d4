"""The serving scenarios of `make gpu-check` (benchmarks.gpu_check): local clusters started
with `baton up` in a subprocess, on the bundled model, every worker on `--device cuda`.

- `colocated`: one colocated worker; its greedy answers are the reference.
- `kv_tcp`, `kv_nixl`, `kv_nccl`: `baton up --prefill 1 --decode 1 --device cuda
  --gpu-memory-utilization 0.4` behind the router, asked through the OpenAI client, KV forced
  over one transport (tcp staged through host buffers, NIXL VRAM to VRAM; NCCL needs two
  devices: gpu_check skips it with the reason on one).
- `tp2`: one worker with tensor parallelism over two GPUs (answers reported, not compared:
  two ranks reduce in another order).

    python -m benchmarks.gpu_scenarios NAME --json OUT --logs DIR [--model DIR]
        [--reference colocated.json] [--timeout-s 120]

Each disaggregated run passes only when its greedy answers equal the colocated ones, the long
prompts' KV really moved (bytes pulled, no failed pull, no fallback) and every worker holds
no KV block and no lease once the requests are done. The KV pull rate (bytes pulled over the
seconds the pulls took, from the decode worker's /metrics) is reported per transport.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from benchmarks.procs import free_port_run, tail, wait_ready

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 32
GPU_MEMORY_UTILIZATION = "0.4"
SENTENCES = (
    "The relay team trained every morning on the old cinder track behind the school. ",
    "Each runner knew the exact mark where the baton had to change hands. ",
    "A clean exchange saved more time than any single stride could win. ",
    "Their coach timed the handoffs and wrote the splits in a worn notebook. ",
)


def prompts() -> list[str]:
    """Short prompts (prefilled on the decode worker) and long ones (> 256 tokens: prefilled
    on the prefill worker, their KV pulled by the decode worker)."""
    long_text = "".join(SENTENCES[i % 4] for i in range(40))  # ~600 tokens
    return ["What is the capital of France?", "Write one sentence about rivers.",
            long_text + "\nSummarise the story above in one sentence.",
            long_text[200:] + "\nWhat did the coach write down?",
            long_text + long_text[:900] + "\nList two facts from the text."]


def baton_command() -> list[str]:
    script = Path(sys.executable).with_name("baton")
    return [str(script)] if script.exists() else [sys.executable, "-m", "baton.cli"]


@contextmanager
def baton_up(flags: list[str], num_workers: int, ready_timeout_s: float, log: Path):
    """`baton up --port P FLAGS` in its own process group until ready; yields (router URL,
    worker URLs in port order: prefill before decode); stops the group on exit."""
    port = free_port_run(num_workers + 2)
    cmd = [*baton_command(), "up", "--port", str(port), "--log-level", "warning", *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        workers = [f"http://127.0.0.1:{port + 1 + i}" for i in range(num_workers)]
        try:
            wait_ready(url, proc, ready_timeout_s)
            for worker in workers:
                wait_ready(worker, proc, ready_timeout_s)
        except (RuntimeError, TimeoutError) as err:
            raise RuntimeError(f"{' '.join(cmd)}: {err}; log tail:\n{tail(log)}") from err
        yield url, workers
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the cluster's group (baton up stops its children), SIGKILL after 8 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=8)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def ask(url: str, timeout_s: float) -> list[str]:
    """Greedy chat answers to `prompts()` through the OpenAI client."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=timeout_s, max_retries=0)
    answers = []
    for text in prompts():
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}], temperature=0,
            max_tokens=MAX_TOKENS)
        answers.append(reply.choices[0].message.content)
    return answers


def metrics(url: str) -> dict[str, float]:
    """A worker's or router's /metrics, each sample's name (with labels) -> value."""
    from urllib.request import urlopen

    with urlopen(f"{url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)$", line)
        if m:
            out[m[1]] = float(m[2])
    return out


def total(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def idle_workers(workers: list[str], wait_s: float = 10.0) -> dict[str, dict[str, float]]:
    """Each worker's blocks and leases still held, polled until both are 0 or `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        held = {w: {"kv_blocks_used": total(m, "baton:kv_blocks_used"),
                    "kv_leases_held": total(m, "baton:kv_leases_held")}
                for w, m in ((w, metrics(w)) for w in workers)}
        if all(not any(v.values()) for v in held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.5)


def run_cluster(name: str, flags: list[str], num_workers: int, reference: list[str] | None,
                out_dir: Path, timeout_s: float, disaggregated: bool = False,
                result: dict | None = None) -> dict:
    """One scenario: start, ask, check; the result's `status` is ok, failed or error.
    `result` is filled as it goes (a caller stopped mid-way still has what was found)."""
    log = out_dir / f"{name}-cluster.log"
    started = time.monotonic()
    result = {} if result is None else result
    result.update(flags=flags, log=str(log), status="running")
    try:
        with baton_up(flags, num_workers, timeout_s, log) as (url, workers):
            result["status"] = "asking"
            answers = ask(url, timeout_s)
            result["answers"] = answers
            result["held_after"] = held = idle_workers(workers)
            problems = [f"{w}: {v}" for w, v in held.items() if any(v.values())]
            if disaggregated:
                problems += check_disaggregated(url, workers[-1], answers, reference, result)
        result["status"] = "failed" if problems else "ok"
        if problems:
            result["problems"] = problems
    except Exception as err:  # a scenario's failure is reported, the others still run
        result.update(status="error", error=f"{type(err).__name__}: {err}")
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def check_disaggregated(router: str, decode: str, answers: list[str],
                        reference: list[str] | None, result: dict) -> list[str]:
    problems = [f"prompt {i}: {a!r} != colocated {r!r}"
                for i, (a, r) in enumerate(zip(answers, reference or answers)) if a != r]
    worker, front = metrics(decode), metrics(router)
    pulled = total(worker, "baton:kv_transfer_bytes_total")
    seconds = total(worker, "baton:kv_transfer_seconds_sum")
    result["kv_pull"] = {"bytes": pulled, "seconds": seconds,
                         "gbps": round(pulled / seconds / 1e9, 3) if seconds else None}
    fallbacks = total(worker, "baton:fallbacks_total") + total(front, "baton:fallbacks_total")
    failures = total(worker, "baton:kv_transfer_failures_total")
    if pulled <= 0:
        problems.append("no KV pulled: the long prompts were not prefilled remotely")
    if fallbacks or failures:
        problems.append(f"{fallbacks:g} fallbacks, {failures:g} failed pulls")
    return problems


SCENARIOS = {
    # name: (flags after the model's, workers, compared with the colocated answers)
    "colocated": (["--workers", "1"], 1, False),
    "kv_tcp": (["--prefill", "1", "--decode", "1", "--kv-transport", "tcp"], 2, True),
    "kv_nixl": (["--prefill", "1", "--decode", "1", "--kv-transport", "nixl"], 2, True),
    "kv_nccl": (["--prefill", "1", "--decode", "1", "--kv-transport", "nccl"], 2, True),
    "tp2": (["--workers", "1", "--tensor-parallel-size", "2"], 1, False),
}


def run_scenario(name: str, model: str | None, reference: list[str] | None, out_dir: Path,
                 timeout_s: float, result: dict | None = None) -> dict:
    """One scenario on the device; `reference` (the colocated answers) where it compares."""
    flags, workers, compares = SCENARIOS[name]
    cuda = ["--device", "cuda", "--gpu-memory-utilization", GPU_MEMORY_UTILIZATION]
    model_flags = ["--model", model] if model else []
    result = run_cluster(name, [*model_flags, *flags, *cuda], workers,
                         reference if compares else None, out_dir, timeout_s,
                         disaggregated=compares, result=result)
    if compares and reference is None:  # KV and leaks still checked; answers not compared
        result["reference"] = "none: the colocated scenario gave no answers to compare"
    if name == "tp2" and reference is not None and "answers" in result:
        # Reported, not required: two ranks reduce in another order than one.
        result["equal_to_colocated"] = result["answers"] == reference
    return result


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=tuple(SCENARIOS))
    ap.add_argument("--model", default=None, help="model directory (default: the bundled)")
    ap.add_argument("--reference", type=Path, default=None,
                    help="the colocated scenario's JSON (its answers)")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--logs", type=Path, required=True)
    ap.add_argument("--timeout-s", type=float, default=120.0)
    args = ap.parse_args(argv)
    reference = (json.loads(args.reference.read_text()).get("answers")
                 if args.reference else None)
    args.logs.mkdir(parents=True, exist_ok=True)
    result: dict = {"status": "starting"}

    def save() -> None:  # stopped mid-way too: what it found so far, and where it was
        if result["status"] not in ("ok", "failed", "error"):
            result["error"] = f"stopped while {result['status']}"
            result["status"] = "timeout"
        args.json.write_text(json.dumps(result, indent=1) + "\n")

    def stopped(*_) -> None:  # gpu_check's SIGTERM: report, then unwind (stops the cluster)
        save()
        sys.exit(143)

    signal.signal(signal.SIGTERM, stopped)
    try:
        run_scenario(args.name, args.model, reference, args.logs, args.timeout_s, result)
    finally:
        save()
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
