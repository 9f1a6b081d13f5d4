"""Routing as a pipeline: filters -> weighted scorers -> picker, then the disaggregation
decider once the decode pod is chosen; each plugin registered by name (docs/design.md §6)."""
