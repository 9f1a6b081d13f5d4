"""The engine's seam for disaggregation (read `base.py` first).

One `KVConnector` per engine owns everything about KV that lives elsewhere: leases a prefill
engine holds for decode pods, pulls a decode engine runs, and requests whose blocks must
outlive them. The scheduler calls its few hooks; nothing else in the engine knows about
disaggregation. What a request asks of the seam travels with it as one typed value
(`HoldKV` / `PullKV` / `PullPrefix`, `handoff.py`).
"""

from baton.engine.kv_connector.handoff import HoldKV, KVHandoff, PullKV, PullPrefix

__all__ = ["HoldKV", "KVHandoff", "PullKV", "PullPrefix"]
