"""`baton profile | plan | planner` through argparse as `baton.cli` wires them, and one real
`baton profile --quick` on the bundled model."""

from __future__ import annotations

import argparse
import json
import time

import pytest

from baton.planner.cli import add_subcommands
from baton.planner.profile import Profile
from tests.unit.planner.factories import make_profile


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="baton")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def run(argv: list[str]) -> int:
    args = parse(argv)
    return args.run(args)


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "profile.yaml"
    make_profile().save(path)
    return str(path)


def test_plan_prints_the_table_and_the_answer(profile_file, capsys):
    assert run(["plan", "--profile", profile_file, "--rate", "20", "--ttft-slo", "1",
                "--itl-slo", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "prefill  decode" in out and "meets" in out
    assert "answer: 3 prefill + 3 decode = 6 replicas" in out


def test_plan_json_is_machine_readable(profile_file, capsys):
    assert run(["plan", "--profile", profile_file, "--rate", "20", "--json",
                "--seed", "3", "--prompt-mean", "1000"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["total"] == doc["prefill"] + doc["decode"]
    assert doc["workload"]["seed"] == 3 and doc["workload"]["prompt"]["mean"] == 1000
    assert doc["rows"][-1]["meets"] is True


def test_plan_that_cannot_be_met_exits_1_naming_the_slo(profile_file, capsys):
    assert run(["plan", "--profile", profile_file, "--rate", "1", "--itl-slo", "0.001"]) == 1
    assert "ITL p90 <= 0.001 s cannot be met" in capsys.readouterr().err


def test_plan_rejects_a_bad_profile_naming_the_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("version: 1\nmodel: m\n")
    with pytest.raises(ValueError, match=r"dtype is missing"):
        run(["plan", "--profile", str(path), "--rate", "1"])


def test_planner_accepts_the_charts_flags():
    # the arguments charts/baton/templates/planner.yaml passes
    args = parse(["planner", "--namespace", "prod", "--prefill-deployment", "b-prefill",
                  "--decode-deployment", "b-decode", "--metrics-url",
                  "http://b-routers:8000/metrics", "--metrics-url", "http://10.0.0.9:8000/metrics",
                  "--profile", "/etc/p/profile.yaml",
                  "--interval", "30", "--ttft-slo", "1.0", "--itl-slo", "0.05",
                  "--min-prefill", "1", "--max-prefill", "8", "--min-decode", "1",
                  "--max-decode", "8", "--dry-run", "--kube-api", "http://127.0.0.1:1"])
    assert (args.namespace, args.max_decode, args.dry_run) == ("prod", 8, True)
    # every router pod behind the headless Service, and any page named beside it
    assert args.metrics_url == ["http://b-routers:8000/metrics", "http://10.0.0.9:8000/metrics"]
    assert args.parser.prog.endswith("planner") and args.log_level == "info"


def test_planner_with_an_invalid_bound_is_a_value_error(profile_file):
    with pytest.raises(ValueError, match=r"min_decode=5 / max_decode=2"):
        run(["planner", "--prefill-deployment", "p", "--decode-deployment", "d",
             "--metrics-url", "http://127.0.0.1:9/metrics", "--profile", profile_file,
             "--min-decode", "5", "--max-decode", "2"])


@pytest.mark.slow
def test_profile_quick_measures_the_bundled_model(tmp_path, capsys):
    out = tmp_path / "profile.yaml"
    t0 = time.perf_counter()
    assert run(["profile", "--quick", "--out", str(out)]) == 0
    elapsed = time.perf_counter() - t0
    profile = Profile.load(out)
    assert profile.model == "SmolLM2-135M-Instruct" and profile.dtype == "bfloat16"
    assert profile.hardware.device in ("cpu", "cuda") and profile.hardware.torch
    assert [p.tokens for p in profile.prefill.points] == [64, 128, 256, 512]
    assert {(p.batch, p.ctx) for p in profile.decode.points} == {
        (b, c) for b in (1, 2, 4, 8, 16) for c in (64, 256)}
    # 8x the prompt costs more even on a busy machine (the fit itself is checked on
    # synthetic points in test_profile: timings here share two cores with other work)
    seconds = {p.tokens: p.seconds for p in profile.prefill.points}
    assert seconds[512] > seconds[64] > 0
    assert all(p.seconds > 0 and p.ctx_tokens_total >= p.batch * p.ctx
               for p in profile.decode.points)
    assert profile.decode.seconds(16, 16 * 256) >= profile.decode.seconds(1, 64) > 0
    assert "wrote" in capsys.readouterr().out
    from baton_cpu.linear import onednn_bf16_supported

    # ~15 s on 2 idle cores with AVX-512; ~135 s where oneDNN has no bf16 (AVX2: F.linear)
    assert elapsed < (120 if onednn_bf16_supported() else 300)
