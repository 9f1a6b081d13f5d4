"""Suffix decoding across requests: agent loops and repeated tasks make a model emit the
same runs again in other requests (tool-call arguments, boilerplate, the same answer to the
same question). The index keeps the outputs of recently finished requests of this engine
in one bounded ring of tokens and, for every n-gram of size `n_min` .. `n_max` in it, the
latest place it ended; a guess is what followed the longest n-gram the request's latest
tokens end with.

Bounded: `capacity` tokens in the ring (the oldest overwritten) and an entry per n-gram
size per token at most, dropped with the tokens they point at; lookups are dictionary
probes, O(n_max)."""

from __future__ import annotations

from collections.abc import Sequence


class SuffixIndex:
    def __init__(self, capacity: int = 1 << 18, n_min: int = 2, n_max: int = 8) -> None:
        if capacity < 64 or not 1 <= n_min <= n_max:
            raise ValueError(f"SuffixIndex: capacity={capacity} must be >= 64 and "
                             f"1 <= n_min={n_min} <= n_max={n_max}")
        self.capacity, self.n_min, self.n_max = capacity, n_min, n_max
        self._ring: list[int] = [0] * capacity
        self._written = 0  # tokens ever written; position p lives at p % capacity
        self._seq_start = [0] * capacity  # where the output holding each position starts
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> position just after it

    def __len__(self) -> int:
        return min(self._written, self.capacity)

    def add(self, tokens: Sequence[int]) -> None:
        """Index a finished request's output (its last `capacity` tokens at most)."""
        tokens = list(tokens[-self.capacity:])
        start = self._written
        for i, token in enumerate(tokens):
            pos = start + i
            self._forget(pos - self.capacity)  # the token this one overwrites
            self._ring[pos % self.capacity] = token
            self._seq_start[pos % self.capacity] = start
            for n in range(self.n_min, min(self.n_max, i) + 1):
                self._ends[tuple(tokens[i - n:i])] = pos  # n tokens, then tokens[i]
        self._written = start + len(tokens)

    def lookup(self, context: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the longest n-gram `context` ends with, in the
        most recent output holding it; [] when none does."""
        for n in range(min(self.n_max, len(context)), self.n_min - 1, -1):
            pos = self._ends.get(tuple(context[-n:]))
            if pos is None or pos < self._written - self.capacity:
                continue
            seq = self._seq_start[pos % self.capacity]
            out: list[int] = []
            while len(out) < k and pos < self._written and \
                    self._seq_start[pos % self.capacity] == seq:
                out.append(self._ring[pos % self.capacity])
                pos += 1
            return out
        return []

    def _forget(self, old: int) -> None:
        """Drop the n-grams that start at position `old`, about to be overwritten (their
        tokens are still in the ring: later slots are overwritten after this one)."""
        if old < 0:
            return
        seq = self._seq_start[old % self.capacity]
        for n in range(self.n_min, self.n_max + 1):
            last = old + n - 1
            if last >= self._written or self._seq_start[last % self.capacity] != seq:
                break
            gram = tuple(self._ring[(old + j) % self.capacity] for j in range(n))
            if self._ends.get(gram) == old + n:
                del self._ends[gram]
