"""The GPU benchmark script runs end to end on CPU at tiny sizes (kernels in Triton's
interpreter, the engine on the torch backend) and prints the tables and the JSON it promises."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from benchmarks.gpu_bench import DECODE_WARMUP_STEPS, main
from tests.unit.deploy.kube import ROOT

pytest.importorskip("triton")
# The run takes ~10 s and, on a fresh cache, converts the bundled model for its tokenizer.
slow = pytest.mark.slow

NUM = r"([0-9][0-9.e+-]*)"
KERNEL_ROW = re.compile(rf"^\s*(\d+)\s+(\d+)\s+{NUM}\s+{NUM}\s+{NUM}%$")
ENGINE_ROW = re.compile(rf"^\s*(\d+)\s+(\d+)\s+(off|on)\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}$")
MAX_TOKENS = 8
# The four KV sizes are 32, 64, 128 and 256 KiB; the 0.0002 GiB limit (210 KB) skips the last.
ARGS = ["all", "--device", "cpu", "--shape", "tiny", "--batches", "1,2", "--contexts", "64,256",
        "--mem-limit-gib", "0.0002", "--decode-batches", "1,4", "--prompt-len", "16",
        "--max-tokens", str(MAX_TOKENS), "--copy-mib", "16", "--repeats", "2"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """One CPU run of `all`: (stdout lines, the --json file's results)."""
    out = tmp_path_factory.mktemp("gpu_bench") / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_bench", *ARGS, "--json", str(out)],
        env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
        timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout.splitlines(), json.loads(out.read_text())


def rows(lines: list[str], pattern: re.Pattern) -> dict[tuple[int, int], list[float]]:
    found = {}
    for line in lines:
        m = pattern.match(line)
        if m:
            found[(int(m[1]), int(m[2]))] = [float(v) for v in m.groups()[2:]]
    return found


@slow
def test_header_and_copy_bandwidth(bench):
    lines, results = bench
    assert lines[0].startswith("device: cpu, torch ") and " triton " in lines[0]
    copy = next(ln for ln in lines if ln.startswith("copy bandwidth:"))
    assert float(re.search(rf"{NUM} GB/s", copy)[1]) > 0
    assert results["copy"]["bytes"] == 16 << 20 and results["copy"]["gbps"] > 0


@slow
def test_kernel_table_has_every_point_that_fits_and_skips_the_rest(bench):
    lines, results = bench
    table = rows(lines, KERNEL_ROW)
    assert set(table) == {(1, 64), (1, 256), (2, 64)}
    assert all(v > 0 for values in table.values() for v in values)
    assert any(re.match(r"^\s*2\s+256\s+skipped: needs 0.000244 GiB$", ln) for ln in lines)
    points = {(p["batch"], p["context"]): p for p in results["kernels"]["points"]}
    assert points[(2, 256)]["skipped"] and points[(2, 256)]["kv_bytes"] == 256 << 10
    assert points[(1, 256)]["kv_bytes"] == 1 * 256 * 2 * 64 * 2 * 2  # B*ctx*KVH*D*(K,V)*bf16
    summary = next(ln for ln in lines if ln.startswith("best at batch >= 1 x context >= 64:"))
    assert "target >= 70%: " in summary
    best = results["kernels"]["best_large"]
    assert best["fraction_of_copy"] == max(p["fraction_of_copy"] for p in points.values()
                                           if not p["skipped"])


@slow
def test_engine_times_only_full_decode_steps(bench):
    lines, results = bench
    engine = results["engine"]
    assert engine["attention_backend"] == "torch" and engine["cuda_graphs"] is False
    assert any("attention backend torch, CUDA graphs off" in ln for ln in lines)
    table = {(int(m[1]), int(m[2]), m[3]): [float(v) for v in m.groups()[3:]]
             for m in map(ENGINE_ROW.match, lines) if m}
    full = MAX_TOKENS - 1 - DECODE_WARMUP_STEPS
    # every batch in both modes; scheduling ahead, the last token is pending one step sooner
    assert set(table) == {(1, full, "off"), (4, full, "off"), (1, full - 1, "on"),
                          (4, full - 1, "on")}
    assert all(v > 0 for values in table.values() for v in values)
    assert [(r["batch"], r["async_scheduling"]) for r in engine["batches"]] == [
        (1, "off"), (4, "off"), (1, "on"), (4, "on")]
    for row in engine["batches"]:
        seconds = row["steps"] * row["step_ms_mean"] / 1e3
        assert row["output_tok_s"] == pytest.approx(row["batch"] * row["steps"] / seconds)
        assert 0 < row["device_busy"] <= 1
        # only a step launched ahead is timed on the device
        assert (row["device_ms"] is not None) == (row["async_scheduling"] == "on")


@slow
def test_engine_rows_carry_the_sim_profiles_model_of_the_same_step(bench):
    from baton.engine.sim.profile import load_profile
    from benchmarks.gpu_bench import SHAPES
    from benchmarks.sim_calibration import modelled_ms, with_shape

    lines, results = bench
    engine = results["engine"]
    sim = with_shape(load_profile("h100-llama3-8b"), SHAPES["tiny"], 2, 2)
    for row in engine["batches"]:
        contexts = [16 + DECODE_WARMUP_STEPS + k for k in range(row["steps"])]
        assert row["sim_ms"] == pytest.approx(modelled_ms(sim, row["batch"], contexts))
        assert row["measured_over_sim"] == pytest.approx(row["step_ms_mean"] / row["sim_ms"])
    assert engine["sim"]["profile"] == "h100-llama3-8b"
    assert engine["sim"]["profile_device"]["memory_bandwidth_gbs"] == 2850
    assert any(ln.startswith("sim profile h100-llama3-8b: memory_bandwidth_gbs 2850") for ln in lines)


@slow
def test_weight_floor_uses_the_same_copy_bandwidth(bench):
    lines, results = bench
    floor = results["engine"]["weight_floor"]
    # tiny shape: embedding + head 2*49152*256, 2 layers of attention, MLP and norms, bf16
    per_layer = 256 * (4 + 2 * 2) * 64 + 4 * 64 * 256 + 3 * 256 * 512 + 2 * 256
    assert floor["weight_bytes"] == 2 * (2 * 49152 * 256 + 2 * per_layer + 256)
    assert floor["floor_ms"] == pytest.approx(
        1e3 * floor["weight_bytes"] / (results["copy"]["gbps"] * 1e9))
    line = next(ln for ln in lines if ln.startswith("batch-1 decode step "))
    ratio = float(re.search(rf"ratio {NUM}x \(target <= 1.5x\)", line)[1])
    assert ratio == pytest.approx(floor["step_over_floor"], rel=0.01) and ratio > 0


@slow
def test_last_line_is_the_json_of_the_file(bench):
    lines, results = bench
    assert json.loads(lines[-1]) == results


@pytest.mark.parametrize("argv, message", [
    (["kernels", "--device", "cpu"], "TRITON_INTERPRET=1"),
    (["engine", "--device", "cpu", "--num-heads", "5"], "num_heads divisible"),
    (["engine", "--device", "cpu", "--max-tokens", "2"], "--max-tokens >= "),
])
def test_bad_arguments_stop_before_measuring(argv, message, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit):
        main(argv)
    captured = capsys.readouterr()
    assert message in captured.err and "copy bandwidth" not in captured.out
