"""The quantized-linears GPU benchmark runs end to end on CPU at the tiny shape (kernels in
Triton's interpreter, FP8 routed as an sm_90 would) and writes every format's row, each
compared with bf16."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.gpu_quant_bench import FORMATS, layer_shapes, main
from tests.unit.deploy.kube import ROOT

pytest.importorskip("triton")


def test_every_format_runs_and_is_compared_with_bf16(tmp_path):
    out = tmp_path / "quant.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_quant_bench", "--layers", "1", "--batches",
         "1", "--repeats", "1", "--json", str(out)],
        env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
        timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert json.loads(proc.stdout.splitlines()[-1]) == results
    assert results["shape"] == "tiny" and list(results["formats"]) == list(FORMATS)
    for fmt, rows in results["formats"].items():
        assert set(rows) == {"1"}
        for row in rows.values():
            assert row["step_ms"] > 0 and row["weight_bytes"] > 0
            assert (row["vs_bf16"] is None) == (fmt == "bf16")
    bf16, w4 = (results["formats"][f]["1"]["weight_bytes"] for f in ("bf16", "w4a16_g128"))
    assert bf16 == 2 * sum(n * k for n, k in layer_shapes("tiny"))
    assert bf16 / 4 < w4 < bf16 / 3.5  # int4 codes and a bf16 scale per 128
    assert results["fp8_batch1_vs_bf16"] == results["formats"]["fp8_channel"]["1"]["vs_bf16"]


def test_refuses_cpu_without_the_interpreter(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit):
        main(["--formats", "bf16"])
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err
