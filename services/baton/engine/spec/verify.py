"""Greedy verification: the target model scored a request's last known token and its k
guesses as one chunk, so its argmax at row i is what it would have produced after the
guesses before i. Guesses are kept while they equal those argmaxes; the first row that
disagrees (or the row after the last guess) gives the target's own next token. The kept
tokens are exactly what k + 1 plain decode steps would have produced."""

from __future__ import annotations


def accepted_run(guesses: list[int], targets: list[int]) -> int:
    """How many of `guesses` the target's tokens (`targets`, one more than guesses) keep."""
    n = 0
    while n < len(guesses) and guesses[n] == targets[n]:
        n += 1
    return n
