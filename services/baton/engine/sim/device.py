"""The simulated device's timeline, asynchronous as a GPU's stream: `launch` queues a step
and returns at once (when the step will end), `wait` blocks until a step's modelled end —
what reading a step's results costs the host. Host work done between the two overlaps the
step for free, exactly as it would on CUDA."""

from __future__ import annotations

import time
from collections.abc import Callable

SPIN_S = 100e-6  # the last stretch of a wait is spun: sleep overshoots by ~50-100 us


class SimDevice:
    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._clock, self._sleep = clock, sleep
        self._free_at = 0.0  # when the last queued step ends
        self._launched_s = 0.0  # modelled seconds of every step launched
        self.idle_s = 0.0  # seconds the device waited on the host (launches with `since`)

    @property
    def busy_s(self) -> float:
        """Modelled seconds the device has worked so far: the steps launched, less what of
        them is still ahead of the clock (queued work counts as it runs, as CUDA events time
        it, so a window's busy fraction never counts a step before it happens)."""
        return self._launched_s - max(0.0, self._free_at - self._clock())

    def launch(self, seconds: float, since: float | None = None) -> float:
        """Queue a step of `seconds`: it starts when the device is free. Returns its end.
        `since`: when the host began the work that led to this launch; the device's wait
        for it (from then, or from its last step's end if later) counts in `idle_s`."""
        now = self._clock()
        if since is not None:
            self.idle_s += max(0.0, now - max(self._free_at, since))
        start = max(now, self._free_at)
        self._free_at = start + seconds
        self._launched_s += seconds
        return self._free_at

    def wait(self, done_at: float) -> None:
        """Block until `done_at` (a `launch`'s answer)."""
        left = done_at - self._clock()
        if left > SPIN_S:
            self._sleep(left - SPIN_S)
        while self._clock() < done_at:
            pass

    def drain(self) -> None:
        """Block until every step launched has ended."""
        self.wait(self._free_at)
