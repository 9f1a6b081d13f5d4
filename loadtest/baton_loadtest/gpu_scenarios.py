"""The serving scenarios of `make gpu-check` (baton_loadtest.gpu_check): local clusters started
with `baton up` in a subprocess, on the bundled model, every worker on `--device cuda`.

- `colocated`: one colocated worker; its greedy answers are the reference.
- `disagg_up` (scenario 2): `baton up --prefill 1 --decode 1 --device cuda
  --gpu-memory-utilization 0.4` behind the router, asked through the OpenAI client.
- `kv_nixl` / `kv_nccl` (scenario 1): the same pair, KV forced over one transport (NIXL
  VRAM to VRAM on one GPU; NCCL needs two devices and is skipped with the reason on one).

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

from baton_loadtest.procs import free_port_run, wait_ready

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
    """SIGTERM to the cluster's group (baton up stops its children), SIGKILL after 30 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def tail(path: Path, chars: int = 2000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


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
                out_dir: Path, timeout_s: float) -> dict:
    """One scenario: start, ask, check; the result's `status` is ok, failed or error."""
    log = out_dir / f"{name}.log"
    started = time.monotonic()
    result: dict = {"flags": flags, "log": str(log)}
    try:
        with baton_up(flags, num_workers, timeout_s, log) as (url, workers):
            answers = ask(url, timeout_s)
            result["answers"] = answers
            result["held_after"] = held = idle_workers(workers)
            problems = [f"{w}: {v}" for w, v in held.items() if any(v.values())]
            if reference is not None:
                problems += check_disaggregated(url, workers[-1], answers, reference, result)
        result["status"] = "failed" if problems else "ok"
        if problems:
            result["problems"] = problems
    except Exception as err:  # a scenario's failure is reported, the others still run
        result.update(status="error", error=f"{type(err).__name__}: {err}")
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def check_disaggregated(router: str, decode: str, answers: list[str], reference: list[str],
                        result: dict) -> list[str]:
    problems = [f"prompt {i}: {a!r} != colocated {r!r}"
                for i, (a, r) in enumerate(zip(answers, reference)) if a != r]
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


def run_all(device_count: int, out_dir: Path, timeout_s: float) -> dict[str, dict]:
    """Every scenario in order (the colocated reference first)."""
    cuda = ["--device", "cuda", "--gpu-memory-utilization", GPU_MEMORY_UTILIZATION]
    disagg = ["--prefill", "1", "--decode", "1", *cuda]
    results = {"colocated": run_cluster("colocated", ["--workers", "1", *cuda], 1, None,
                                        out_dir, timeout_s)}
    reference = results["colocated"].get("answers")
    if reference is None:
        reason = "the colocated reference run did not answer"
        return {**results, **{k: {"status": "skipped", "reason": reason}
                              for k in ("disagg_up", "kv_nixl", "kv_nccl")}}
    results["disagg_up"] = run_cluster("disagg_up", disagg, 2, reference, out_dir, timeout_s)
    results["kv_nixl"] = run_cluster("kv_nixl", [*disagg, "--kv-transport", "nixl"], 2,
                                     reference, out_dir, timeout_s)
    if device_count < 2:
        results["kv_nccl"] = {"status": "skipped", "reason": (
            f"nccl needs two CUDA devices (a pair group of two ranks); {device_count} here")}
    else:
        results["kv_nccl"] = run_cluster("kv_nccl", [*disagg, "--kv-transport", "nccl"], 2,
                                         reference, out_dir, timeout_s)
    return results
