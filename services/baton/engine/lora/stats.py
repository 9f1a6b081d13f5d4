"""Per-adapter counters: requests, loads and evictions, host and resident, read by the
worker's `/metrics` (`baton:lora_*`). Written from the engine thread and the threads that
load adapters, read from the event loop: one lock."""

from __future__ import annotations

import threading
from collections import Counter

# the counters' names: requests served, their prompt tokens and generated tokens (the
# worker's count); host copies read from disk and dropped (`--max-cpu-loras`); resident
# copies made and evicted (`--max-loras`)
KINDS = ("requests", "prompt_tokens", "generation_tokens", "host_loads", "host_evictions",
         "loads", "evictions")


class LoRACounters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, Counter[str]] = {kind: Counter() for kind in KINDS}

    def count(self, kind: str, adapter: str, n: int = 1) -> None:
        with self._lock:
            self._counts[kind][adapter] += n

    def snapshot(self) -> dict[str, dict[str, int]]:
        """kind -> adapter -> count, a copy."""
        with self._lock:
            return {kind: dict(c) for kind, c in self._counts.items()}
