"""The KV cache's host offload tier under the device pool (`--kv-offload-gib`): blocks the
pool evicts are copied to host memory and loaded back on a later prefix hit, through the
engine's KV connector seam (`connector.py`; the loads in flight and their per-step bound in
`loads.py`), so the scheduler needs no special case. Under it, optionally (`--kv-disk-dir`),
a bounded directory of checksummed blocks (`disk_pool.py`) that a restarted pod reads back,
its file I/O on one background thread (`disk_worker.py`)."""

from baton.engine.kv_tier.connector import TierConnector
from baton.engine.kv_tier.disk_pool import DiskKVPool, fingerprint
from baton.engine.kv_tier.disk_worker import DiskWorker
from baton.engine.kv_tier.host_pool import HostKVPool

__all__ = ["DiskKVPool", "DiskWorker", "HostKVPool", "TierConnector", "fingerprint"]
