"""`baton plan`: the fewest prefill + decode replicas that meet a TTFT and an ITL target.

The search simulates (`planner.simulate`) instead of guessing in closed form:

1. prefill pool: p = 1, 2, ... until the prefill pool alone meets the TTFT target (the
   decode queue can only add to TTFT, so this p is a lower bound);
2. decode pool: with that p, d = 1, 2, ... until ITL meets its target and requests wait for
   a decode batch slot no longer than one ITL target (the pool keeps up);
3. the pair is verified in the joint simulation; while it fails, one replica is added to the
   pool whose addition helps most (both are tried), until it passes or the bounds are hit.

The pools are nearly independent (prefill sets TTFT, decode sets ITL), so step 3 rarely runs.
Deterministic for a given seed: every candidate replays the same trace.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from baton.planner.profile import Profile
from baton.planner.simulate import (
    JointResult,
    SimResult,
    SimSettings,
    Trace,
    Workload,
    draw_trace,
    simulate,
    simulate_prefill,
)
from baton.planner.speculation import NO_SPECULATION, Speculation


@dataclass(frozen=True)
class SLO:
    ttft_s: float  # time to first token target at `percentile`
    itl_s: float  # inter-token latency target at `percentile`
    percentile: float = 90.0

    def __post_init__(self) -> None:
        for name in ("ttft_s", "itl_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"SLO.{name}={value} must be > 0 seconds")
        if not 0 < self.percentile < 100:
            raise ValueError(f"SLO.percentile={self.percentile} must be in (0, 100)")

    @property
    def label(self) -> str:
        return f"p{self.percentile:g}"


@dataclass(frozen=True)
class PlanSettings:
    slo: SLO
    max_replicas: int = 16  # prefill + decode
    max_prefill: int | None = None  # None: max_replicas - 1
    max_decode: int | None = None  # None: max_replicas - 1
    transfer_s: float = 0.005  # KV hand-off per request, added to TTFT
    max_num_seqs: int | None = None  # decode pods' largest batch; None: the profile's
    # speculative decoding on the decode pods: given, or learnt from their counters by
    # the live planner (planner.speculation)
    speculation: Speculation = NO_SPECULATION

    def __post_init__(self) -> None:
        if self.max_replicas < 2:
            raise ValueError(f"PlanSettings.max_replicas={self.max_replicas} must be >= 2 "
                             "(one prefill and one decode replica)")
        for name in ("max_prefill", "max_decode", "max_num_seqs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"PlanSettings.{name}={value} must be >= 1")

    @property
    def prefill_cap(self) -> int:
        return min(self.max_prefill or self.max_replicas, self.max_replicas - 1)

    @property
    def decode_cap(self) -> int:
        return min(self.max_decode or self.max_replicas, self.max_replicas - 1)


@dataclass(frozen=True)
class PlanRow:
    prefill: int
    decode: int | None  # None: the prefill pool simulated alone
    ttft_s: float
    itl_s: float | None
    meets: bool
    verdict: str  # "yes", or what fails: "ttft", "itl", "decode queue"


@dataclass(frozen=True)
class Plan:
    prefill: int
    decode: int
    rows: tuple[PlanRow, ...]
    slo: SLO
    workload: Workload

    @property
    def total(self) -> int:
        return self.prefill + self.decode

    def to_json(self) -> dict:
        return {"prefill": self.prefill, "decode": self.decode, "total": self.total,
                "slo": asdict(self.slo), "workload": asdict(self.workload),
                "rows": [asdict(r) for r in self.rows]}


class PlanError(Exception):
    """No configuration within the bounds meets the SLO; the message names the target that
    fails and the best value reached. `rows` holds what was simulated."""

    def __init__(self, message: str, rows: tuple[PlanRow, ...] = ()) -> None:
        super().__init__(message)
        self.rows = rows


def plan(profile: Profile, workload: Workload, settings: PlanSettings,
         trace: Trace | None = None) -> Plan:
    """`trace`: the requests to plan for (e.g. the ones a load test will send); None draws
    them from `workload`."""
    search = _Search(profile, workload, settings, trace)
    p = search.prefill_pool()
    d = search.decode_pool(p)
    p, d = search.verify(p, d)
    return Plan(p, d, tuple(search.rows), settings.slo, workload)


class _Search:
    def __init__(self, profile: Profile, workload: Workload, settings: PlanSettings,
                 trace: Trace | None = None) -> None:
        self.profile, self.settings, self.slo = profile, settings, settings.slo
        self.trace = trace if trace is not None else draw_trace(
            workload, profile.limits.max_model_len)
        self.sim = SimSettings.for_profile(profile, settings.transfer_s,
                                           settings.slo.percentile, settings.max_num_seqs,
                                           settings.speculation)
        self.rows: list[PlanRow] = []
        self._joint: dict[tuple[int, int], JointResult] = {}

    def fail(self, message: str) -> PlanError:
        return PlanError(message, tuple(self.rows))

    # -- step 1 ----------------------------------------------------------------------------
    def prefill_pool(self) -> int:
        slo, q = self.slo, self.slo.percentile
        service = self.profile.prefill.chunked_seconds(self.trace.prompt, self.sim.chunk_tokens)
        floor = float(np.percentile(service, q)) + self.sim.transfer_s
        if floor > slo.ttft_s:
            raise self.fail(f"TTFT {slo.label} <= {slo.ttft_s:g} s cannot be met: prefilling "
                            f"the prompts alone takes {floor:.3f} s at {slo.label} on this "
                            "profile, before any queueing (shorter prompts or faster hardware)")
        best: SimResult | None = None
        for p in range(1, self.settings.prefill_cap + 1):
            r = simulate_prefill(self.trace, p, self.profile, self.sim)
            meets = r.ttft_s <= slo.ttft_s
            self.rows.append(PlanRow(p, None, r.ttft_s, None, meets, "yes" if meets else "ttft"))
            if meets:
                return p
            best = r if best is None or r.ttft_s < best.ttft_s else best
        assert best is not None  # prefill_cap >= 1 (PlanSettings checks max_replicas >= 2)
        raise self.fail(f"TTFT {slo.label} <= {slo.ttft_s:g} s fails with up to "
                        f"{self.settings.prefill_cap} prefill replicas: the best is "
                        f"{best.ttft_s:.3f} s with {best.prefill} (raise --max-replicas)")

    # -- step 2 ----------------------------------------------------------------------------
    def decode_pool(self, p: int) -> int:
        slo, cost, spec = self.slo, self.profile.decode, self.sim.speculation
        # a token's ITL at batch 1: one step (its guesses are rows) over the tokens it gives
        floor = (cost.batch_seconds(spec.rows_per_step)
                 + cost.e * (int(self.trace.prompt.min()) + 1)) / spec.tokens_per_step
        if floor > slo.itl_s:
            per = " per token (with its speculation)" if spec.is_on else ""
            raise self.fail(f"ITL {slo.label} <= {slo.itl_s:g} s cannot be met: a decode step "
                            f"takes at least {floor:.4f} s{per} on this profile, even at "
                            "batch 1")
        best: JointResult | None = None
        for d in range(1, min(self.settings.decode_cap, self.settings.max_replicas - p) + 1):
            r = self.joint(p, d)
            if r.itl_s <= slo.itl_s and r.decode_wait_s <= slo.itl_s:
                return d
            best = r if best is None or r.itl_s < best.itl_s else best
        if best is None:
            raise self.fail(f"no room for a decode replica: {p} prefill replicas reach "
                            f"--max-replicas={self.settings.max_replicas}")
        raise self.fail(f"ITL {slo.label} <= {slo.itl_s:g} s fails with up to {best.decode} "
                        f"decode replicas: the best is {best.itl_s:.4f} s (decode queue "
                        f"{best.decode_wait_s:.3f} s; raise --max-replicas)")

    # -- step 3 ----------------------------------------------------------------------------
    def verify(self, p: int, d: int) -> tuple[int, int]:
        r = self.joint(p, d)
        while not self._meets(r):
            options = [(p + 1, d), (p, d + 1)]
            options = [(a, b) for a, b in options if a <= self.settings.prefill_cap
                       and b <= self.settings.decode_cap and a + b <= self.settings.max_replicas]
            if not options:
                raise self.fail(self._exhausted(r))
            tried = [self.joint(a, b) for a, b in options]
            r = min(tried, key=lambda t: (not self._meets(t), self._excess(t)))
            p, d = r.prefill, r.decode
        return p, d

    def joint(self, p: int, d: int) -> JointResult:
        if (p, d) not in self._joint:
            r = simulate(self.trace, p, d, self.profile, self.sim)
            self._joint[p, d] = r
            fails = self._fails(r)
            self.rows.append(PlanRow(p, d, r.ttft_s, r.itl_s, self._meets(r),
                                     ", ".join(fails) or "yes"))
        return self._joint[p, d]

    def _fails(self, r: JointResult) -> list[str]:
        fails = ["ttft"] if r.ttft_s > self.slo.ttft_s else []
        fails += ["itl"] if r.itl_s > self.slo.itl_s else []
        fails += ["decode queue"] if r.decode_wait_s > self.slo.itl_s else []
        return fails

    def _meets(self, r: JointResult) -> bool:
        return r.ttft_s <= self.slo.ttft_s and r.itl_s <= self.slo.itl_s

    def _excess(self, r: JointResult) -> float:
        return max(r.ttft_s / self.slo.ttft_s, r.itl_s / self.slo.itl_s)

    def _exhausted(self, r: JointResult) -> str:
        slo, s = self.slo, self.settings
        failing = []
        if r.ttft_s > slo.ttft_s:
            failing.append(f"TTFT {slo.label} <= {slo.ttft_s:g} s (reached {r.ttft_s:.3f} s)")
        if r.itl_s > slo.itl_s:
            failing.append(f"ITL {slo.label} <= {slo.itl_s:g} s (reached {r.itl_s:.4f} s)")
        return (f"no configuration within --max-replicas={s.max_replicas} meets "
                f"{' and '.join(failing)}; the last tried was {r.prefill} prefill + "
                f"{r.decode} decode replicas")


# -- output -------------------------------------------------------------------------------
def format_rows(rows: tuple[PlanRow, ...] | list[PlanRow], slo: SLO) -> str:
    head = (f"{'prefill':>7}  {'decode':>6}  {'ttft_' + slo.label + '_s':>12}  "
            f"{'itl_' + slo.label + '_s':>11}  meets")
    lines = [head]
    for r in rows:
        decode = "-" if r.decode is None else str(r.decode)
        itl = "-" if r.itl_s is None else f"{r.itl_s:.4f}"
        meets = "yes" if r.meets else f"no ({r.verdict})"
        if r.decode is None and r.meets:
            meets = "yes (prefill alone)"
        lines.append(f"{r.prefill:>7}  {decode:>6}  {r.ttft_s:>12.3f}  {itl:>11}  {meets}")
    return "\n".join(lines)


def format_plan(result: Plan, profile: Profile) -> str:
    w, slo = result.workload, result.slo
    return "\n".join([
        f"profile: {profile.model} {profile.dtype} on {_hardware(profile)}",
        f"workload: {w.rate:g} req/s; prompt mean {w.prompt.mean:g} tokens (sigma "
        f"{w.prompt.sigma:g}, max {w.prompt.max}); output mean {w.output.mean:g} tokens "
        f"(sigma {w.output.sigma:g}, max {w.output.max}); {w.num_requests} requests, "
        f"seed {w.seed}",
        f"SLO: TTFT {slo.label} <= {slo.ttft_s:g} s, ITL {slo.label} <= {slo.itl_s:g} s",
        format_rows(result.rows, slo),
        f"answer: {result.prefill} prefill + {result.decode} decode = {result.total} replicas"])


def _hardware(profile: Profile) -> str:
    hw = profile.hardware
    return hw.gpu if hw.gpu else f"{hw.cpu}, {hw.threads} threads"
