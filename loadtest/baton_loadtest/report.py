"""Summaries, SLO goodput, the result files and the plots.

Goodput counts the requests that succeeded and met every SLO given (their TTFT, each of
their inter-token gaps, their end-to-end latency), divided by the run's wall time; `goodput_ratio` is
that count over all requests sent, so a sweep can ask "did >= 90% of the offered load get
good service?".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from baton_loadtest.client import RequestRecord

PCTS = (50, 90, 95, 99)


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    itl_s: float | None = None
    e2e_s: float | None = None

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_s is not None and (r.ttft_s is None or r.ttft_s > self.ttft_s):
            return False
        if self.itl_s is not None and any(g > self.itl_s for g in r.itl_s):
            return False
        return self.e2e_s is None or (r.e2e_s is not None and r.e2e_s <= self.e2e_s)

    def to_dict(self) -> dict:
        return {"ttft_s": self.ttft_s, "itl_s": self.itl_s, "e2e_s": self.e2e_s}


def _stats(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    a = np.asarray(values, dtype=float)
    out = {"count": int(a.size), "mean": float(a.mean()), "max": float(a.max())}
    for p in PCTS:
        out[f"p{p}"] = float(np.percentile(a, p))
    return out


def summarize(records: list[RequestRecord], wall_s: float, slo: SLO,
              offered_rate: float | None = None) -> dict:
    ok = [r for r in records if r.ok]
    good = [r for r in records if slo.met(r)]
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    return {
        "requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
        "wall_s": wall_s, "offered_rate": offered_rate,
        "request_throughput": len(ok) / wall_s if wall_s else 0.0,
        "output_token_throughput": out_tokens / wall_s if wall_s else 0.0,
        "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "ttft_s": _stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": _stats([g for r in ok for g in r.itl_s]),
        "tpot_s": _stats([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": _stats([r.e2e_s for r in ok if r.e2e_s is not None]),
        "slo": slo.to_dict(), "good": len(good),
        "goodput": len(good) / wall_s if wall_s else 0.0,
        "goodput_ratio": len(good) / len(records) if records else 0.0,
        "error_samples": sorted({r.error for r in records if r.error})[:5],
    }


def write_result(out_dir: Path, meta: dict, records: list[RequestRecord], summary: dict
                 ) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "result.json"
    path.write_text(json.dumps({"meta": meta, "summary": summary,
                                "requests": [r.to_dict() for r in records]}, indent=1))
    (out_dir / "summary.md").write_text(markdown(meta, summary))
    plot_cdfs(records, out_dir / "latency_cdf.png")
    plot_timeline(records, out_dir / "inflight.png")
    return path


def load_result(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def markdown(meta: dict, s: dict) -> str:
    lines = [f"# {meta.get('workload', 'run')} against {meta.get('base_url', '?')}", "",
             f"{s['requests']} requests, {s['ok']} ok, {s['errors']} errors in "
             f"{s['wall_s']:.1f} s; {s['request_throughput']:.2f} req/s, "
             f"{s['output_token_throughput']:.1f} output tok/s; goodput "
             f"{s['goodput']:.2f} req/s ({100 * s['goodput_ratio']:.1f}% of requests met the "
             f"SLOs {_slo_text(s['slo'])}).", "",
             "| metric | mean | p50 | p90 | p95 | p99 | max |", "|---|---:|---:|---:|---:|---:|---:|"]
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("tpot_s", "TPOT"),
                       ("e2e_s", "E2E")):
        st = s[key]
        if not st.get("count"):
            lines.append(f"| {label} (ms) | - | - | - | - | - | - |")
            continue
        cells = [st["mean"]] + [st[f"p{p}"] for p in PCTS] + [st["max"]]
        lines.append(f"| {label} (ms) | " + " | ".join(f"{1e3 * v:.1f}" for v in cells) + " |")
    if s["error_samples"]:
        lines += ["", "Errors (samples):", *[f"- `{e}`" for e in s["error_samples"]]]
    return "\n".join(lines) + "\n"


def _slo_text(slo: dict) -> str:
    parts = [f"{k.removesuffix('_s').upper()} <= {v * 1e3:.0f} ms" for k, v in slo.items()
             if v is not None]
    return "(" + ", ".join(parts) + ")" if parts else "(none given)"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, axes, path: Path) -> None:
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_cdfs(records: list[RequestRecord], path: Path) -> None:
    plt = _plt()
    ok = [r for r in records if r.ok]
    series = {"TTFT": [r.ttft_s for r in ok if r.ttft_s is not None],
              "ITL": [g for r in ok for g in r.itl_s],
              "E2E": [r.e2e_s for r in ok if r.e2e_s is not None]}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (name, values) in zip(axes, series.items()):
        if values:
            xs = np.sort(np.asarray(values)) * 1e3
            ax.plot(xs, np.arange(1, xs.size + 1) / xs.size)
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
    _save(plt, fig, axes, path)


def plot_timeline(records: list[RequestRecord], path: Path) -> None:
    """Requests in flight over the run (sent, not yet finished or failed)."""
    plt = _plt()
    events = []
    for r in records:
        end = r.sent_s + (r.e2e_s if r.e2e_s is not None else 0.0)
        events += [(r.sent_s, 1), (end, -1)]
    events.sort()
    ts, level, cur = [0.0], [0], 0
    for t, d in events:
        cur += d
        ts.append(t)
        level.append(cur)
    fig, ax = plt.subplots(figsize=(10, 3.5))
    ax.step(ts, level, where="post")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("requests in flight")
    _save(plt, fig, [ax], path)


def plot_sweep(rows: list[dict], path: Path, target: float = 0.9) -> None:
    plt = _plt()
    rates = [r["offered_rate"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(rates, [r["request_throughput"] for r in rows], "o-", label="throughput")
    ax.plot(rates, [r["goodput"] for r in rows], "s-", label="goodput (SLOs met)")
    ax.plot(rates, [target * x for x in rates], ":", color="grey",
            label=f"{target:.0%} of offered")
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("req/s")
    ax.legend()
    _save(plt, fig, [ax], path)


COMPARE_KEYS = [("request_throughput", "req/s", 1), ("output_token_throughput", "out tok/s", 1),
                ("goodput", "goodput req/s", 1), ("ttft_s.p50", "TTFT p50 ms", 1e3),
                ("ttft_s.p99", "TTFT p99 ms", 1e3), ("itl_s.p50", "ITL p50 ms", 1e3),
                ("itl_s.p99", "ITL p99 ms", 1e3), ("tpot_s.p50", "TPOT p50 ms", 1e3),
                ("e2e_s.p50", "E2E p50 ms", 1e3), ("e2e_s.p99", "E2E p99 ms", 1e3)]


def compare(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> str:
    """Markdown table of two summaries side by side with B/A ratios."""
    def get(s: dict, key: str):
        for part in key.split("."):
            s = s.get(part) if isinstance(s, dict) else None
        return s

    lines = [f"| metric | {name_a} | {name_b} | {name_b}/{name_a} |", "|---|---:|---:|---:|"]
    for key, label, scale in COMPARE_KEYS:
        va, vb = get(a, key), get(b, key)
        if va is None or vb is None:
            continue
        ratio = f"{vb / va:.2f}x" if va else "-"
        lines.append(f"| {label} | {va * scale:.2f} | {vb * scale:.2f} | {ratio} |")
    return "\n".join(lines) + "\n"
