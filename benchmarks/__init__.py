"""Baton's own benchmarks and the GPU check: the engine offline, the serving path, the router,
the KV transports, Baton against vLLM, the planner against served runs, `make gpu-check`.

Not shipped in the wheel (the generic load tool is `baton_loadtest`, which they use); run
them from the repository root, e.g. `python -m benchmarks.offline_bench` or the Makefile's
bench targets (docs/benchmarks.md).
"""
