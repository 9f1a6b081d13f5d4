"""Prompt lookup: guess that the text goes on as it did after the last earlier place where
the request's latest n tokens appeared (its prompt and output alike), for the largest n in
[prompt_lookup_min, prompt_lookup_max] that matches. Input-grounded answers (edits, quotes,
re-emitted tool arguments) repeat long runs of their prompt, and each matching run can be
accepted whole.

Each request's tokens live in a growing numpy buffer (appended as outputs come, never
rebuilt), so a lookup is a few vectorised passes over its length: ~20 us at 3k tokens."""

from __future__ import annotations

import numpy as np


class TokenHistory:
    """A request's tokens as an int64 array that grows by appending."""

    def __init__(self, tokens: list[int]) -> None:
        self.buf = np.empty(max(64, 2 * len(tokens)), dtype=np.int64)
        self.len = 0
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        need = self.len + len(tokens)
        if need > len(self.buf):
            grown = np.empty(2 * need, dtype=np.int64)
            grown[:self.len] = self.buf[:self.len]
            self.buf = grown
        self.buf[self.len:need] = tokens
        self.len = need

    @property
    def tokens(self) -> np.ndarray:
        return self.buf[:self.len]


def lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of n_max .. n_min tokens; [] when none occurs."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n:]
        # starts s < length - n with tokens[s:s + n] == suffix
        hits = np.flatnonzero(tokens[:length - n] == suffix[0])
        for j in range(1, n):
            if len(hits) == 0:
                break
            hits = hits[tokens[hits + j] == suffix[j]]
        if len(hits):
            start = int(hits[-1]) + n  # the latest match: the freshest context
            return tokens[start:start + k].tolist()
    return []
