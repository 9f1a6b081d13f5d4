"""`benchmarks.scenarios vs-vllm`: the SLO rule, the highest passing rate, the target ratios, the
report and plot from synthetic sweeps, the flags and the vLLM-skip message; one slow run end to end
against Baton alone."""

from __future__ import annotations

import json

import pytest

from baton_loadtest.client import RequestRecord
from baton_loadtest.report import summarize
from baton_loadtest.spec import WorkloadSpec
from benchmarks import vs_vllm
from benchmarks import vs_vllm_report as vr
from benchmarks.scenarios import main

SLO = vr.TpotSLO(ttft_s=2.0, itl_s=0.2)
TINY = """
name: tiny
seed: 1
num_requests: 6
prompt_tokens: {dist: lognormal, median: 40, sigma: 0.5, min: 8, max: 120}
output_tokens: {dist: uniform, min: 4, max: 12}
arrival: {process: poisson, rate: 2.0}
"""


def rec(ttft=0.5, gaps=(0.1, 0.1, 0.1), ok=True) -> RequestRecord:
    e2e = ttft + sum(gaps)
    return RequestRecord(0, 0.0, ok=ok, ttft_s=ttft, itl_s=list(gaps), e2e_s=e2e,
                         output_tokens=len(gaps) + 1)


def row(rate: float, ratio: float, itl_p99: float = 0.1) -> dict:
    """A summary row of a run at `rate` where `ratio` of the requests met the SLOs."""
    stats = {"count": 10, "p50": itl_p99 / 2, "p99": itl_p99}
    return {"offered_rate": rate, "goodput_ratio": ratio, "goodput": rate * ratio,
            "ttft_s": stats, "itl_s": stats, "e2e_s": stats}


def test_tpot_rule_judges_the_requests_mean_gap_not_its_worst():
    spiky = rec(gaps=(0.05, 0.4, 0.05))  # TPOT 0.17: one long gap, the mean within
    assert SLO.met(spiky)
    assert not SLO.met(rec(gaps=(0.3, 0.3, 0.1)))  # TPOT 0.233
    assert not SLO.met(rec(ttft=2.5))
    assert not SLO.met(rec(ok=False))
    assert SLO.met(rec(gaps=()))  # one token: no TPOT, passes the ITL bound as in vLLM
    # beside it the strict share, every gap under the bound: the spiky request fails it
    assert vr.every_gap_ratio([spiky, rec()], SLO) == 0.5
    s = summarize([spiky, rec(), rec(ttft=3.0), rec(ok=False)], 2.0, SLO)
    assert s["good"] == 2 and s["goodput_ratio"] == 0.5 and s["goodput"] == 1.0


def test_highest_passing_rate_exact_lower_bound_and_none():
    assert vr.highest_passing([row(1, 1.0), row(2, 0.95), row(4, 0.6)]) == {
        "rate": 2, "bound": "exact"}
    assert vr.highest_passing([row(1, 1.0), row(2, 0.9)]) == {"rate": 2, "bound": "lower bound"}
    assert vr.highest_passing([row(1, 0.89), row(2, 0.2)]) == {"rate": None, "bound": "none"}


def test_common_rate_is_the_highest_shared_unless_asked():
    by = {"a": [row(1, 1), row(2, 1), row(3, 1)], "b": [row(1, 1), row(2, 0.4)]}
    assert vr.common_rate(by, None) == 2
    assert vr.common_rate(by, 1.0) == 1
    assert vr.common_rate(by, 3.0) == 2  # not run by b: the highest shared instead
    assert vr.common_rate({"a": [row(1, 1)], "b": [row(2, 1)]}, None) is None


def test_chat_ratio_is_baton_best_over_vllm_with_its_kind():
    chat = {"vllm": [row(1, 1), row(2, 0.95), row(3, 0.5)],
            "baton-colocated": [row(1, 1), row(2, 1), row(3, 0.92), row(4, 0.3)],
            "baton-disagg": [row(1, 1), row(2, 0.7)]}
    r = vr.chat_rate_ratio(chat)
    assert (r["baton_system"], r["value"], r["kind"], r["met"]) == (
        "baton-colocated", 1.5, "measured", True)
    chat["baton-colocated"] = chat["baton-colocated"][:3]  # now it passed at its top rate
    r = vr.chat_rate_ratio(chat)
    assert (r["value"], r["kind"], r["met"]) == (1.5, "at least", True)
    chat["vllm"] = [row(1, 1), row(2, 1), row(3, 1)]  # both bounds: nothing can be said
    assert vr.chat_rate_ratio(chat)["met"] is None
    chat["vllm"] = [row(1, 0.5)]
    r = vr.chat_rate_ratio(chat)
    assert (r["value"], r["kind"], r["met"]) == (3.0, "more than", True)
    assert vr.chat_rate_ratio({"baton-disagg": chat["baton-disagg"]})["kind"] == "not run"


def test_report_when_no_baton_system_met_the_slos_but_vllm_did(tmp_path):
    results = {"vllm": {"chat": [row(0.5, 1), row(1, 1)]},
               "baton-colocated": {"chat": [row(0.5, 0.67), row(1, 0.2)]}}
    vr.write(tmp_path, meta(), results, vr.analyse(results, None))
    md = (tmp_path / "report.md").read_text()
    assert "Baton best (baton-colocated, none) / vLLM (>= 1 req/s" in md or \
        "Baton best (baton-colocated, none) / vLLM (1 req/s)" in md
    assert "(target >= 1.3x: not met)" in md


def test_long_prefill_ratio_at_the_common_rate_and_every_shared_rate():
    long = {"vllm": [row(0.5, 1, 0.4), row(1, 1, 0.8)],
            "baton-disagg": [row(0.5, 1, 0.1), row(1, 1, 0.5), row(2, 1, 0.6)]}
    r = vr.long_itl_ratio(long, 1.0)
    assert r["value"] == pytest.approx(0.625) and r["met"] is False
    assert r["per_rate"] == {"0.5": pytest.approx(0.25), "1": pytest.approx(0.625)}
    assert vr.long_itl_ratio(long, 0.5)["met"] is True
    assert vr.long_itl_ratio({"vllm": long["vllm"]}, 1.0)["value"] is None


def synthetic_results() -> dict:
    return {"vllm": {"chat": [row(1, 1), row(2, 0.95), row(4, 0.4)],
                     "long_prefill": [row(0.5, 1, 0.4), row(1, 0.8, 0.9)]},
            "baton-colocated": {"chat": [row(1, 1), row(2, 1), row(4, 0.93)],
                                "long_prefill": [row(0.5, 1, 0.3), row(1, 1, 0.5)]},
            "baton-disagg": {"chat": [row(1, 0.5), row(2, 0.2)],
                             "long_prefill": [row(0.5, 1, 0.1), row(1, 1, 0.2)]}}


def meta() -> dict:
    settings = {"model": vs_vllm.MODEL, "model_dir": "/m", "dtype": "bfloat16",
                "max_num_batched_tokens": 2048, "max_num_seqs": 128, "kv_cache_gib": 2,
                "cores": 2, "cpu": "test CPU", "slo": SLO.to_dict(), "per_point": "20 requests",
                "rate_note": "-"}
    return {"settings": settings, "systems": {
        "vllm": {"placement": "both cores", "commands": ["VLLM_X=1 python -m vllm.x --port 1"]},
        "baton-colocated": {"placement": "one worker", "commands": ["baton up --workers 1"]},
        "baton-disagg": {"skipped": "failed: boom"}}}


def test_report_and_plot_from_synthetic_results(tmp_path):
    results = synthetic_results()
    analysis = vr.analyse(results, None)
    vr.write(tmp_path, meta(), results, analysis)
    data = json.loads((tmp_path / "report.json").read_text())
    t = data["analysis"]["targets"]
    assert t["chat_rate_ratio"]["value"] == pytest.approx(2.0)  # colocated >= 4 / vLLM 2
    assert t["chat_rate_ratio"]["kind"] == "at least"
    assert t["long_prefill_itl_p99_ratio"]["value"] == pytest.approx(0.2 / 0.9)
    chat = data["analysis"]["workloads"]["chat"]
    assert chat["common_rate"] == 2  # baton-disagg stopped at 2
    assert chat["systems"]["vllm"]["at_common_rate"]["attainment"] == 0.95
    md = (tmp_path / "report.md").read_text()
    assert "`VLLM_X=1 python -m vllm.x --port 1`" in md
    assert "baton-disagg**: skipped — failed: boom" in md
    assert "(baton-colocated, 4 req/s) / vLLM (2 req/s): at least **2.00x** (target >= 1.3x: met)" in md
    assert "**0.22x** (target <= 0.5x: met)" in md
    assert "| baton-colocated | >= 4 (passed at the highest rate swept) |" in md
    assert "| baton-disagg | none of the rates swept | 0.50 (50%) | 0.40 (20%) | - |" in md
    assert "| vllm | 2 | 1.00 (100%) | 1.90 (95%) | 1.60 (40%) |" in md
    assert "max-num-batched-tokens 2048" in md and "bfloat16" in md
    png = (tmp_path / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_rates_flags_and_defaults():
    rates = vs_vllm.parse_rates(["chat=3,0.5,1"], ["chat", "long_prefill"])
    assert rates["chat"] == [0.5, 1.0, 3.0]
    assert rates["long_prefill"] == list(vs_vllm.DEFAULT_RATES["long_prefill"])
    assert vs_vllm.parse_rates(["1,2"], ["chat", "x"]) == {"chat": [1.0, 2.0], "x": [1.0, 2.0]}
    for bad in ("nope=1,2", "chat=a", "chat=0,1"):
        with pytest.raises(ValueError, match="--rates"):
            vs_vllm.parse_rates([bad], ["chat"])
    assert list(vs_vllm.workload_paths("chat,long_prefill")) == ["chat", "long_prefill"]
    with pytest.raises(FileNotFoundError):
        vs_vllm.workload_paths("no_such_workload")


def test_point_spec_sizes_runs_by_time_and_whole_sessions():
    class A:
        seconds_per_point, min_requests, num_requests = 30.0, 20, None

    chat = WorkloadSpec.load(vs_vllm.WORKLOAD_DIR / "chat.yaml")
    assert vs_vllm.point_spec(chat, 2.0, A).num_requests == 60
    assert vs_vllm.point_spec(chat, 0.1, A).num_requests == 20  # the floor
    s = vs_vllm.point_spec(chat, 2.0, A)
    assert (s.arrival.process, s.arrival.rate) == ("poisson", 2.0)
    shared = WorkloadSpec.load(vs_vllm.WORKLOAD_DIR / "shared_prefix.yaml")
    p = vs_vllm.point_spec(shared, 1.0, A)  # 30 sessions/run of 4 turns each
    assert (p.num_requests, p.sessions.count) == (120, 30)
    A.num_requests = 10
    assert vs_vllm.point_spec(chat, 2.0, A).num_requests == 10


def test_every_point_and_the_warm_up_draw_their_own_prompts(tokenizer):
    """A point replaying an earlier point's prompts would measure prefix-cache hits."""
    from baton_loadtest.generator import RequestFactory

    class A:
        seconds_per_point, min_requests, num_requests = 10.0, 4, 4

    chat = WorkloadSpec.load(vs_vllm.WORKLOAD_DIR / "chat.yaml")
    specs = [vs_vllm.point_spec(chat, 1.0, A, k) for k in range(3)]
    assert len({s.seed for s in specs} | {chat.seed, vs_vllm.WARMUP_SEED}) == 5
    firsts = [[RequestFactory(s, tokenizer).request(i).prompt for i in range(4)]
              for s in specs]
    assert not set(firsts[0]) & set(firsts[1]) and not set(firsts[1]) & set(firsts[2])


def test_request_timeout_is_the_latest_a_request_could_still_meet_the_slos():
    chat = WorkloadSpec.load(vs_vllm.WORKLOAD_DIR / "chat.yaml")  # outputs up to 512 tokens
    assert vs_vllm.request_timeout(chat, SLO) == pytest.approx(2.0 + 0.2 * 511 + 10)
    long = WorkloadSpec.load(vs_vllm.WORKLOAD_DIR / "long_prefill.yaml")  # fixed 48
    assert vs_vllm.request_timeout(long, SLO) == pytest.approx(2.0 + 0.2 * 47 + 10)


def test_without_vllm_python_vllm_is_skipped_with_a_message(capsys):
    class A:
        systems, vllm_python = "vllm,baton-colocated", None

    names, skipped = vs_vllm.chosen_systems(A)
    assert names == ["baton-colocated"] and "--vllm-python" in skipped["vllm"]
    assert "vLLM skipped: no --vllm-python given" in capsys.readouterr().out
    A.systems = "vllm,sglang"
    with pytest.raises(ValueError, match="choose from"):
        vs_vllm.chosen_systems(A)


def test_vllm_command_line_has_the_shared_budget(tmp_path):
    budget = vs_vllm.Budget("/models/m", "bfloat16", 512, 16, 3)
    cmd = vs_vllm.VllmServer("/venv/bin/python", budget, tmp_path / "log", 5).commands[0]
    assert cmd.startswith("VLLM_CPU_KVCACHE_SPACE=3 VLLM_CPU_OMP_THREADS_BIND=")
    for part in ("/venv/bin/python -m vllm.entrypoints.openai.api_server", "--model /models/m",
                 "--dtype bfloat16", "--max-num-batched-tokens 512", "--max-num-seqs 16",
                 f"--served-model-name {vs_vllm.MODEL}"):
        assert part in cmd


def test_baton_systems_get_the_same_budget_and_disagg_one_core_each():
    budget = vs_vllm.Budget("/models/m", "bfloat16", 512, 16, 3)
    shared = "--dtype bfloat16 --max-num-batched-tokens 512 --max-num-seqs 16 --kv-cache-gib 3"
    colocated = vs_vllm.BatonServer(False, budget, None, 256, 5)
    assert colocated.commands == [f"baton up --workers 1 {shared}"]
    assert colocated.cluster.num_workers == 1
    disagg = vs_vllm.BatonServer(True, budget, None, 128, 5)
    assert disagg.commands[0] == ("baton up --prefill 1 --decode 1 --disagg-min-prefill-tokens"
                                  f" 128 {shared} --num-threads 1 --kv-transport tcp")
    assert (disagg.cluster.num_prefill, disagg.cluster.num_decode) == (1, 1)
    first, second = disagg.cores()
    assert disagg.placement == (f"prefill on core {first}, decode on core {second}, router "
                                f"and client on core {second}")


def test_other_scenarios_still_need_a_workload(tmp_path, capsys):
    assert main(["chunk-sweep", "--out", str(tmp_path)]) == 2
    assert "needs --workload" in capsys.readouterr().err


@pytest.mark.slow
def test_vs_vllm_end_to_end_against_baton(tmp_path):
    """Baton colocated alone, one small workload at one rate, a few requests."""
    wl = tmp_path / "tiny.yaml"
    wl.write_text(TINY)
    out = tmp_path / "vs"
    code = main(["vs-vllm", "--systems", "vllm,baton-colocated", "--workloads",
                 str(wl), "--rates", "tiny=2", "--num-requests", "6", "--warmup-requests", "2",
                 "--out", str(out), "--no-progress", "--slo-ttft", "300", "--slo-itl", "60"])
    assert code == 0
    data = json.loads((out / "report.json").read_text())
    rows = data["results"]["baton-colocated"]["tiny"]
    assert len(rows) == 1 and rows[0]["requests"] == rows[0]["ok"] == rows[0]["good"] == 6
    assert data["meta"]["systems"]["vllm"]["skipped"].startswith("no --vllm-python")
    assert data["analysis"]["workloads"]["tiny"]["systems"]["baton-colocated"][
        "highest_passing"] == {"rate": 2.0, "bound": "lower bound"}
    assert (out / "sweep.png").exists() and (out / "baton-colocated" / "tiny" / "rate_2"
                                             / "result.json").exists()
