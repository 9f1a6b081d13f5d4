"""Paged KV cache bookkeeping: the block pool, prefix hashes and the scheduler's handle."""

from baton.engine.kv_cache.manager import KVCacheManager

__all__ = ["KVCacheManager"]
