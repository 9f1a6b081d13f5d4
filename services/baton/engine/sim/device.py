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
        self.busy_s = 0.0  # modelled seconds of every step launched

    def launch(self, seconds: float) -> float:
        """Queue a step of `seconds`: it starts when the device is free. Returns its end."""
        start = max(self._clock(), self._free_at)
        self._free_at = start + seconds
        self.busy_s += seconds
        return self._free_at

    def wait(self, done_at: float) -> None:
        """Block until `done_at` (a `launch`'s answer)."""
        left = done_at - self._clock()
        if left > SPIN_S:
            self._sleep(left - SPIN_S)
        while self._clock() < done_at:
            pass
