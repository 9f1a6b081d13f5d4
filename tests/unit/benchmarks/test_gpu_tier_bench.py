"""The GPU check's KV tier piece runs its whole path on CPU (memcpy numbers): the tier's own
copies each way, each loaded block equal to the one offloaded, and the step's timings."""

from __future__ import annotations

import json

from benchmarks.gpu_check_pieces import PIECES
from benchmarks.gpu_tier_bench import main


def test_the_tier_bench_copies_and_checks_on_cpu(tmp_path):
    out = tmp_path / "tier.json"
    assert main(["--blocks", "8", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    copies, step = result["copies"], result["step"]
    assert result["device"] == "cpu" and copies["loaded_equal_offloaded"]
    assert copies["block_bytes"] == 30 * 2 * 16 * 3 * 64 * 2  # the bundled model's, bf16
    assert copies["offload_gbps"] > 0 and copies["load_gbps"] > 0
    assert step["offloads"] == 8 and step["step_ms"] > 0 and step["offloads_ms"] > 0
    assert "bench_kv_tier" in {p.name for p in PIECES if p.gpus == 1}
