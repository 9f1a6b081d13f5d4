"""Routing as a pipeline: filters -> weighted scorers -> picker, each plugin registered by
name (DESIGN.md §6)."""
