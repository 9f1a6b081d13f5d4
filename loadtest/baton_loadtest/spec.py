"""Workload files: small YAML documents, parsed into frozen, validated specs.

    name: chat
    seed: 0
    num_requests: 200            # or duration_s: 60
    prompt_tokens: {dist: lognormal, median: 150, sigma: 0.9, min: 8, max: 1024}
    output_tokens: {dist: lognormal, median: 100, sigma: 0.6, min: 4, max: 512}
    arrival: {process: poisson, rate: 4.0}
    # optional:
    system_prompt_tokens: 200    # one system prompt shared by every request
    sessions: {count: 20, turns: 4, think_time_s: 2.0}   # multi-turn conversations

Length distributions: `lognormal` (median, sigma, clipped to [min, max]), `fixed` (value),
`uniform` (min, max, inclusive). Arrival processes: `poisson` (rate), `gamma` (rate and
`burstiness`: 1 is Poisson, below 1 burstier), `step` (a list of `rates`, each held
`step_s` seconds), `closed` (`concurrency` clients, each sending its next request when the
previous one ends). An error names the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

DISTS = ("lognormal", "fixed", "uniform")
PROCESSES = ("poisson", "gamma", "step", "closed")


class SpecError(ValueError):
    pass


def _need(ok: bool, where: str, msg: str) -> None:
    if not ok:
        raise SpecError(f"{where}: {msg}")


@dataclass(frozen=True)
class LengthSpec:
    dist: str = "fixed"
    value: int = 128
    median: float = 128.0
    sigma: float = 0.5
    min: int = 1
    max: int = 4096

    @classmethod
    def parse(cls, raw: object, where: str) -> LengthSpec:
        if isinstance(raw, int):
            raw = {"dist": "fixed", "value": raw}
        _need(isinstance(raw, dict), where, "must be a number or a mapping with `dist`")
        raw = dict(raw)
        _need(raw.get("dist") in DISTS, f"{where}.dist", f"must be one of {DISTS}")
        _need(not set(raw) - {"dist", "value", "median", "sigma", "min", "max"}, where,
              f"unknown keys {sorted(set(raw) - set(cls.__dataclass_fields__))}")
        spec = cls(**raw)
        if spec.dist == "fixed":
            _need(spec.value >= 1, f"{where}.value", "must be >= 1")
        if spec.dist == "lognormal":
            _need(spec.median >= 1, f"{where}.median", "must be >= 1")
            _need(spec.sigma >= 0, f"{where}.sigma", "must be >= 0")
        if spec.dist in ("lognormal", "uniform"):
            _need(1 <= spec.min <= spec.max, where, "needs 1 <= min <= max")
        return spec


@dataclass(frozen=True)
class ArrivalSpec:
    process: str = "poisson"
    rate: float = 1.0  # requests/s (poisson, gamma)
    burstiness: float = 1.0  # gamma shape
    rates: tuple[float, ...] = ()  # step
    step_s: float = 10.0
    concurrency: int = 1  # closed

    @classmethod
    def parse(cls, raw: object, where: str = "arrival") -> ArrivalSpec:
        _need(isinstance(raw, dict), where, "must be a mapping with `process`")
        raw = dict(raw)
        _need(raw.get("process") in PROCESSES, f"{where}.process",
              f"must be one of {PROCESSES}")
        unknown = set(raw) - set(cls.__dataclass_fields__)
        _need(not unknown, where, f"unknown keys {sorted(unknown)}")
        if "rates" in raw:
            raw["rates"] = tuple(float(r) for r in raw["rates"])
        spec = cls(**raw)
        spec.check(where)
        return spec

    def check(self, where: str = "arrival") -> None:
        if self.process in ("poisson", "gamma"):
            _need(self.rate > 0, f"{where}.rate", "must be > 0")
        if self.process == "gamma":
            _need(self.burstiness > 0, f"{where}.burstiness", "must be > 0")
        if self.process == "step":
            _need(bool(self.rates) and all(r > 0 for r in self.rates), f"{where}.rates",
                  "must be a non-empty list of rates > 0")
            _need(self.step_s > 0, f"{where}.step_s", "must be > 0")
        if self.process == "closed":
            _need(self.concurrency >= 1, f"{where}.concurrency", "must be >= 1")


@dataclass(frozen=True)
class SessionSpec:
    count: int = 0  # 0 = independent requests
    turns: int = 1
    think_time_s: float = 0.0


@dataclass(frozen=True)
class WorkloadSpec:
    name: str = "workload"
    seed: int = 0
    num_requests: int | None = 100
    duration_s: float | None = None
    prompt_tokens: LengthSpec = field(default_factory=LengthSpec)
    output_tokens: LengthSpec = field(default_factory=lambda: LengthSpec(value=64))
    arrival: ArrivalSpec = field(default_factory=ArrivalSpec)
    system_prompt_tokens: int = 0
    sessions: SessionSpec = field(default_factory=SessionSpec)
    # "text": prompts cut from a corpus; "grounded": a passage (code or prose, about 4
    # characters per prompt token) and an ask to edit, reformat or quote it (`grounded.py`)
    content: str = "text"

    @classmethod
    def load(cls, path: str | Path) -> WorkloadSpec:
        try:
            raw = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as err:
            raise SpecError(f"{path}: not valid YAML: {err}") from None
        return cls.parse(raw, str(path))

    @classmethod
    def parse(cls, raw: object, where: str = "workload") -> WorkloadSpec:
        _need(isinstance(raw, dict), where, "must be a mapping")
        known = set(cls.__dataclass_fields__)
        _need(not set(raw) - known, where, f"unknown keys {sorted(set(raw) - known)}")
        kw = dict(raw)
        if "prompt_tokens" in kw:
            kw["prompt_tokens"] = LengthSpec.parse(kw["prompt_tokens"], f"{where}.prompt_tokens")
        if "output_tokens" in kw:
            kw["output_tokens"] = LengthSpec.parse(kw["output_tokens"], f"{where}.output_tokens")
        if "arrival" in kw:
            kw["arrival"] = ArrivalSpec.parse(kw["arrival"], f"{where}.arrival")
        if "sessions" in kw:
            s = kw["sessions"]
            _need(isinstance(s, dict) and not set(s) - set(SessionSpec.__dataclass_fields__),
                  f"{where}.sessions", "must be a mapping of count, turns, think_time_s")
            kw["sessions"] = SessionSpec(**s)
        if "duration_s" in kw and "num_requests" not in kw:
            kw["num_requests"] = None
        spec = cls(**kw)
        spec.check(where)
        return spec

    def check(self, where: str = "workload") -> None:
        _need((self.num_requests is None) != (self.duration_s is None), where,
              "give exactly one of num_requests and duration_s")
        _need(self.num_requests is None or self.num_requests >= 1, f"{where}.num_requests",
              "must be >= 1")
        _need(self.duration_s is None or self.duration_s > 0, f"{where}.duration_s",
              "must be > 0")
        _need(self.system_prompt_tokens >= 0, f"{where}.system_prompt_tokens", "must be >= 0")
        _need(self.content in ("text", "grounded"), f"{where}.content",
              "must be 'text' or 'grounded'")
        s = self.sessions
        _need(s.count >= 0 and s.turns >= 1 and s.think_time_s >= 0, f"{where}.sessions",
              "needs count >= 0, turns >= 1, think_time_s >= 0")
        _need(s.count == 0 or self.arrival.process != "closed", f"{where}.sessions",
              "sessions use open-loop arrivals (their turns follow think times)")
        self.arrival.check(f"{where}.arrival")

    def with_overrides(self, num_requests: int | None = None, rate: float | None = None,
                       concurrency: int | None = None) -> WorkloadSpec:
        spec = self
        if num_requests is not None:
            spec = replace(spec, num_requests=num_requests, duration_s=None)
        if rate is not None:
            process = spec.arrival.process if spec.arrival.process in ("poisson",
                                                                       "gamma") else "poisson"
            spec = replace(spec, arrival=replace(spec.arrival, process=process, rate=rate))
        if concurrency is not None:
            spec = replace(spec, arrival=ArrivalSpec(process="closed", concurrency=concurrency))
        spec.check()
        return spec
