"""The analysis and the report of `benchmarks.scenarios vs-vllm` (the runs: `vs_vllm.py`).

A request meets the SLOs the way vLLM's `benchmark_serving --goodput ttft:T tpot:I` counts
it: it succeeded, its TTFT <= T, and its TPOT — (E2E - TTFT) / (output tokens - 1), the mean
inter-token latency of that request — <= I (a one-token answer has no TPOT and passes that
bound). A run passes at 90%: `good / requests sent >= 0.9`. Beside it the report gives the
stricter attainment of `report.SLO`, which asks every single gap to stay under I.

Ratios are of swept rates, so their resolution is the sweep's grid: a system that still
passes at the highest rate swept has that rate as a lower bound of its true highest rate,
and a ratio built on a bound says so (`kind`).
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path

from baton_loadtest import report
from baton_loadtest.client import RequestRecord

ATTAINMENT = 0.9  # the fraction of requests that must meet the SLOs
ITL_RULE = "per-request TPOT (mean inter-token latency), as vLLM's benchmark --goodput"
CHAT_RATE_TARGET = 1.3  # Baton's best highest passing rate / vLLM's, on chat.yaml
LONG_ITL_TARGET = 0.5  # disaggregated ITL p99 / vLLM's at one offered rate, long_prefill.yaml
BATON_SYSTEMS = ("baton-colocated", "baton-disagg")


@dataclass(frozen=True)
class TpotSLO(report.SLO):
    """`report.SLO` with vLLM's goodput rule for the inter-token bound: the request's TPOT,
    not each of its gaps, must be <= `itl_s`."""

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_s is not None and (r.ttft_s is None or r.ttft_s > self.ttft_s):
            return False
        if self.itl_s is not None and r.tpot_s is not None and r.tpot_s > self.itl_s:
            return False
        return self.e2e_s is None or (r.e2e_s is not None and r.e2e_s <= self.e2e_s)


def every_gap_ratio(records: list[RequestRecord], slo: TpotSLO) -> float:
    """The fraction of requests meeting the SLOs when every gap must be <= the ITL bound."""
    strict = report.SLO(slo.ttft_s, slo.itl_s, slo.e2e_s)
    return sum(strict.met(r) for r in records) / len(records) if records else 0.0


def passes(row: dict) -> bool:
    return row["goodput_ratio"] >= ATTAINMENT


def highest_passing(rows: list[dict]) -> dict:
    """{"rate", "bound"} over one system's rows of one workload: the highest offered rate
    whose run passed; `bound` is "exact" when a higher rate was run and failed,
    "lower bound" when the highest rate run still passed, "none" when no rate passed."""
    ran = sorted(r["offered_rate"] for r in rows)
    good = [r["offered_rate"] for r in rows if passes(r)]
    if not good:
        return {"rate": None, "bound": "none"}
    best = max(good)
    return {"rate": best, "bound": "lower bound" if best == ran[-1] else "exact"}


def common_rate(by_system: dict[str, list[dict]], asked: float | None) -> float | None:
    """The rate every system ran: `asked` when all ran it, else the highest they share."""
    shared = None
    for rows in by_system.values():
        rates = {r["offered_rate"] for r in rows}
        shared = rates if shared is None else shared & rates
    if not shared:
        return None
    return asked if asked in shared else max(shared)


def row_at(rows: list[dict], rate: float | None) -> dict | None:
    return next((r for r in rows if r["offered_rate"] == rate), None)


def _pct(row: dict | None, metric: str, p: int) -> float | None:
    return None if row is None else row[metric].get(f"p{p}")


def chat_rate_ratio(chat: dict[str, list[dict]]) -> dict:
    """Baton's best highest passing rate on chat over vLLM's (target >= 1.3x)."""
    if "vllm" not in chat or not any(s in chat for s in BATON_SYSTEMS):
        return {"value": None, "kind": "not run", "met": None,
                "note": "needs vLLM and a Baton system swept on chat"}
    best = max((highest_passing(chat[s]) | {"system": s} for s in BATON_SYSTEMS if s in chat),
               key=lambda h: -1.0 if h["rate"] is None else h["rate"])
    v = highest_passing(chat["vllm"])
    out = {"baton_system": best["system"], "baton_rate": best["rate"],
           "baton_bound": best["bound"], "vllm_rate": v["rate"], "vllm_bound": v["bound"]}
    if best["rate"] is None:
        return out | {"value": 0.0 if v["rate"] else None, "kind": "measured" if v["rate"]
                      else "undetermined", "met": False if v["rate"] else None,
                      "note": "no Baton system met the SLOs at any rate swept"}
    if v["rate"] is None:  # vLLM's true rate is below its lowest swept rate
        value = best["rate"] / min(r["offered_rate"] for r in chat["vllm"])
        return out | {"value": value, "kind": "more than", "met": True if value >= CHAT_RATE_TARGET
                      else None, "note": "vLLM met the SLOs at none of its rates"}
    value = best["rate"] / v["rate"]
    kind = {("exact", "exact"): "measured", ("lower bound", "exact"): "at least",
            ("exact", "lower bound"): "at most"}.get((best["bound"], v["bound"]), "undetermined")
    met = {"measured": value >= CHAT_RATE_TARGET,
           "at least": True if value >= CHAT_RATE_TARGET else None,
           "at most": False if value < CHAT_RATE_TARGET else None}.get(kind)
    return out | {"value": value, "kind": kind, "met": met, "note": ""}


def long_itl_ratio(long: dict[str, list[dict]], rate: float | None) -> dict:
    """Disaggregated Baton's ITL p99 over vLLM's at one offered rate (target <= 0.5x), and at
    every rate both ran."""
    if "vllm" not in long or "baton-disagg" not in long:
        return {"value": None, "rate": rate, "met": None, "per_rate": {},
                "note": "needs vLLM and baton-disagg swept on long_prefill"}
    per_rate = {}
    for r in sorted({x["offered_rate"] for x in long["vllm"]}
                    & {x["offered_rate"] for x in long["baton-disagg"]}):
        d = _pct(row_at(long["baton-disagg"], r), "itl_s", 99)
        v = _pct(row_at(long["vllm"], r), "itl_s", 99)
        per_rate[f"{r:g}"] = d / v if d is not None and v else None
    value = per_rate.get(f"{rate:g}") if rate is not None else None
    return {"value": value, "rate": rate, "met": None if value is None else
            value <= LONG_ITL_TARGET, "per_rate": per_rate, "note": ""}


def analyse(results: dict[str, dict[str, list[dict]]], asked_common: float | None) -> dict:
    """results: system -> workload -> summary rows (each with `offered_rate`)."""
    workloads = sorted({w for per in results.values() for w in per})
    out: dict = {"workloads": {}, "targets": {}}
    for w in workloads:
        by_system = {s: per[w] for s, per in results.items() if per.get(w)}
        rate = common_rate(by_system, asked_common)
        out["workloads"][w] = {"common_rate": rate, "systems": {s: {
            "highest_passing": highest_passing(rows),
            "goodput": {f"{r['offered_rate']:g}": r["goodput"] for r in rows},
            "attainment": {f"{r['offered_rate']:g}": r["goodput_ratio"] for r in rows},
            "at_common_rate": _latencies(row_at(rows, rate)),
        } for s, rows in by_system.items()}}
    by = {w: {s: per[w] for s, per in results.items() if per.get(w)} for w in workloads}
    out["targets"]["chat_rate_ratio"] = (chat_rate_ratio(by["chat"]) if "chat" in by else
                                         {"value": None, "kind": "not run", "met": None})
    long_rate = out["workloads"].get("long_prefill", {}).get("common_rate")
    out["targets"]["long_prefill_itl_p99_ratio"] = (
        long_itl_ratio(by["long_prefill"], long_rate) if "long_prefill" in by
        else {"value": None, "met": None, "per_rate": {}})
    return out


def _latencies(row: dict | None) -> dict | None:
    if row is None:
        return None
    return {f"{m}_p{p}": _pct(row, f"{m}_s", p) for m in ("ttft", "itl", "e2e")
            for p in (50, 99)} | {"attainment": row["goodput_ratio"], "goodput": row["goodput"],
                                  "every_gap_attainment": row.get("every_gap_ratio")}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


# -- files ---------------------------------------------------------------------------------
def write(out: Path, meta: dict, results: dict, analysis: dict) -> None:
    """report.json, report.md and sweep.png in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(
        {"meta": meta, "results": results, "analysis": analysis}, indent=1))
    (out / "report.md").write_text(markdown(meta, analysis))
    plot(results, out / "sweep.png")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1e3 * v:.0f}"


def _share(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _rate_text(h: dict) -> str:
    if h["rate"] is None:
        return "none of the rates swept"
    if h["bound"] == "lower bound":
        return f">= {h['rate']:g} (passed at the highest rate swept)"
    return f"{h['rate']:g}"


def _targets_md(t: dict) -> list[str]:
    c, lp = t["chat_rate_ratio"], t["long_prefill_itl_p99_ratio"]
    met = {True: "met", False: "not met", None: "undetermined"}
    lines = ["## Targets", ""]
    if c.get("value") is not None:
        vllm_rate, baton_rate = (("none" if r is None else f"{r:g} req/s")
                                 for r in (c["vllm_rate"], c["baton_rate"]))
        lines.append(f"- chat.yaml, highest rate meeting the SLOs, Baton best ({c['baton_system']}"
                     f", {baton_rate}) / vLLM ({vllm_rate}): {c['kind']} "
                     f"**{c['value']:.2f}x** (target >= {CHAT_RATE_TARGET}x: {met[c['met']]})"
                     + (f"; {c['note']}" if c.get("note") else ""))
    else:
        lines.append(f"- chat.yaml rate ratio: {c['kind']} ({c.get('note', '')})")
    if lp.get("value") is not None:
        lines.append(f"- long_prefill.yaml, ITL p99 baton-disagg / vLLM at {lp['rate']:g} req/s:"
                     f" **{lp['value']:.2f}x** (target <= {LONG_ITL_TARGET}x: {met[lp['met']]})"
                     "; at every shared rate: " + ", ".join(
                         f"{r}: {'-' if v is None else f'{v:.2f}x'}"
                         for r, v in lp["per_rate"].items()))
    else:
        lines.append(f"- long_prefill.yaml ITL ratio: not available "
                     f"({lp.get('note', 'no rate both ran')})")
    return lines + [""]


def _workload_md(name: str, w: dict) -> list[str]:
    systems = w["systems"]
    rates = sorted({float(r) for s in systems.values() for r in s["goodput"]})
    lines = [f"## {name}", "", "| system | highest rate meeting the SLOs | " + " | ".join(
        f"{r:g} req/s" for r in rates) + " |", "|---|---|" + "---:|" * len(rates)]
    for s, a in systems.items():
        cells = [f"{a['goodput'][f'{r:g}']:.2f} ({100 * a['attainment'][f'{r:g}']:.0f}%)"
                 if f"{r:g}" in a["goodput"] else "-" for r in rates]
        lines.append(f"| {s} | {_rate_text(a['highest_passing'])} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: goodput in req/s (the share of requests meeting the SLOs).", ""]
    if w["common_rate"] is None:
        return lines + ["No rate was run by every system.", ""]
    lines += [f"At {w['common_rate']:g} req/s (run by every system), latencies in ms (ITL: "
              "every gap of every request; met SLOs: by TPOT, then with every gap bounded):", "",
              "| system | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | E2E p50 | E2E p99 | met SLOs |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s, a in systems.items():
        c = a["at_common_rate"]
        lines.append(f"| {s} | " + " | ".join(_ms(c[k]) for k in (
            "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "e2e_p50", "e2e_p99"))
            + f" | {100 * c['attainment']:.0f}% / {_share(c['every_gap_attainment'])} |")
    return lines + [""]


def markdown(meta: dict, analysis: dict) -> str:
    s = meta["settings"]
    lines = ["# Goodput at equal SLOs: Baton against vLLM's server", "",
             f"Model {s['model']} (`{s['model_dir']}`), dtype {s['dtype']}, "
             f"max-num-batched-tokens {s['max_num_batched_tokens']}, max-num-seqs "
             f"{s['max_num_seqs']}, KV cache {s['kv_cache_gib']} GiB per engine; {s['cores']} "
             f"cores ({s['cpu']}). SLOs: TTFT <= {s['slo']['ttft_s']} s, ITL <= "
             f"{s['slo']['itl_s']} s by request TPOT (vLLM's `--goodput` rule); a rate passes "
             f"when >= {ATTAINMENT:.0%} of its requests meet them. Each point: {s['per_point']}"
             f"; rates are requests/s ({s['rate_note']}). Each system alone on the machine, "
             "warmed, started once for all its points.", "", "## Systems", ""]
    for name, sys_ in meta["systems"].items():
        if sys_.get("skipped"):
            lines.append(f"- **{name}**: skipped — {sys_['skipped']}")
            continue
        lines.append(f"- **{name}** ({sys_['placement']}):")
        lines += [f"  - `{c}`" for c in sys_["commands"]]
    lines += ["", *_targets_md(analysis["targets"])]
    for name, w in analysis["workloads"].items():
        lines += _workload_md(name, w)
    lines += ["![sweep](sweep.png)", ""]
    return "\n".join(lines)


def plot(results: dict[str, dict[str, list[dict]]], path: Path) -> None:
    """Goodput (top) and SLO attainment (bottom) against the offered rate: one panel column
    per workload, one line per system."""
    plt = report._plt()
    workloads = sorted({w for per in results.values() for w in per})
    n = max(1, len(workloads))
    fig, axes = plt.subplots(2, n, figsize=(4.6 * n, 7), squeeze=False)
    for col, w in enumerate(workloads):
        top, bottom = axes[0][col], axes[1][col]
        for system, per in results.items():
            rows = sorted(per.get(w, []), key=lambda r: r["offered_rate"])
            if not rows:
                continue
            xs = [r["offered_rate"] for r in rows]
            top.plot(xs, [r["goodput"] for r in rows], "o-", label=system)
            bottom.plot(xs, [100 * r["goodput_ratio"] for r in rows], "o-", label=system)
        top.set_title(w)
        top.set_ylabel("goodput (req/s)")
        bottom.axhline(100 * ATTAINMENT, ls=":", color="grey")
        bottom.set_ylabel("requests meeting the SLOs (%)")
        bottom.set_xlabel("offered rate (req/s)")
        bottom.set_ylim(0, 105)
        top.legend(fontsize=8)
    report._save(plt, fig, [a for row in axes for a in row], path)
