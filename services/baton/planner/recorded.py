"""A recorded measured run: what the planner is checked against.

`python -m benchmarks.planner_check` writes one after it has served a workload on a local
cluster: the profile it planned with, the simulation settings, the replica counts it ran, the
requests exactly as they were sent (arrival, prompt and output tokens, from the load tester's
records) and the p90 TTFT / ITL the client measured. `predict` replays those requests through
the simulation, so a test can keep checking the model against a real run in milliseconds.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from baton.planner.profile import Profile
from baton.planner.simulate import JointResult, SimSettings, Trace, simulate
from baton.planner.speculation import Speculation

RECORD_VERSION = 1


@dataclass(frozen=True)
class Measured:
    ttft_s: float  # at the settings' percentile, over the requests that succeeded
    itl_s: float  # at the same percentile, over every inter-token gap


@dataclass(frozen=True)
class RecordedRun:
    name: str  # e.g. "chat 1P:1D"
    profile: Profile
    settings: SimSettings
    prefill: int
    decode: int
    trace: Trace
    measured: Measured
    notes: str = ""  # how it was recorded (the command, the machine)

    def predict(self) -> JointResult:
        return simulate(self.trace, self.prefill, self.decode, self.profile, self.settings)

    def errors(self) -> dict[str, float]:
        """Relative error of the prediction, (predicted - measured) / measured."""
        r = self.predict()
        return {"ttft": r.ttft_s / self.measured.ttft_s - 1,
                "itl": r.itl_s / self.measured.itl_s - 1}

    def to_dict(self) -> dict:
        return {"version": RECORD_VERSION, "name": self.name, "notes": self.notes,
                "prefill": self.prefill, "decode": self.decode,
                "profile": self.profile.to_dict(), "settings": asdict(self.settings),
                "measured": asdict(self.measured),
                "trace": {"arrivals": [round(float(t), 6) for t in self.trace.arrivals],
                          "prompt": [int(n) for n in self.trace.prompt],
                          "output": [int(n) for n in self.trace.output]}}

    @classmethod
    def from_dict(cls, raw: dict) -> RecordedRun:
        if raw.get("version") != RECORD_VERSION:
            raise ValueError(f"recorded run: version={raw.get('version')!r} is not supported "
                             f"(expected {RECORD_VERSION}); re-record it")
        t = raw["trace"]
        trace = Trace(np.asarray(t["arrivals"], float), np.asarray(t["prompt"], np.int64),
                      np.asarray(t["output"], np.int64))
        if not (len(trace.arrivals) == len(trace.prompt) == len(trace.output) > 0):
            raise ValueError("recorded run: trace.arrivals, prompt and output must be "
                             "non-empty lists of one length")
        measured = Measured(**raw["measured"])
        if not all(math.isfinite(v) and v > 0 for v in asdict(measured).values()):
            raise ValueError(f"recorded run: measured={asdict(measured)} must be > 0 seconds")
        settings = dict(raw["settings"])  # runs recorded before speculation have none
        settings["speculation"] = Speculation(**settings.get("speculation", {}))
        return cls(raw["name"], Profile.from_dict(raw["profile"], "recorded run profile"),
                   SimSettings(**settings), int(raw["prefill"]), int(raw["decode"]),
                   trace, measured, raw.get("notes", ""))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> RecordedRun:
        return cls.from_dict(json.loads(Path(path).read_text()))
