"""Baton's load and benchmark tools: workload generation, offline and online benchmarks."""
