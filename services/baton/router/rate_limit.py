"""Token buckets: a tenant's requests per second and tokens per minute (`router.tenants`)."""

from __future__ import annotations


class TokenBucket:
    """`capacity` units, refilled at `rate` units a second. Used on the event loop; `now`
    is `time.monotonic()` (passed in, so tests drive the clock)."""

    __slots__ = ("rate", "capacity", "level", "_at")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        if rate <= 0 or capacity <= 0:
            raise ValueError(f"TokenBucket: rate={rate} and capacity={capacity} must be > 0")
        self.rate = rate
        self.capacity = capacity
        self.level = capacity
        self._at = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
        self._at = max(self._at, now)

    def take(self, amount: float, now: float) -> float:
        """Takes `amount` and returns 0.0 when the bucket has it, else takes nothing and
        returns the seconds until it will. An amount above `capacity` waits for a full
        bucket and leaves it in debt (the level goes below zero), so the next callers wait
        for what it took beyond."""
        self._refill(now)
        need = min(amount, self.capacity)
        if self.level >= need:
            self.level -= amount
            return 0.0
        return (need - self.level) / self.rate

    def adjust(self, amount: float, now: float) -> None:
        """Takes `amount` more (a refund when negative) after the fact, e.g. actual usage
        against an estimate; never more than `capacity` is left."""
        self._refill(now)
        self.level = min(self.capacity, self.level - amount)
