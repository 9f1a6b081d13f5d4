"""The engine's one KV connector, from its config: the transport connector of a
disaggregated engine, the host offload tier (wrapping it, when both are on), or none."""

from __future__ import annotations

from pathlib import Path

from baton.engine.config import EngineConfig
from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_connector.base import KVConnector

_GIB = 1 << 30


def make_connector(config: EngineConfig, runner, kv: KVCacheManager,
                   model_dir: Path) -> KVConnector | None:
    """`runner`: the engine's `ModelRunner` (its KV cache, TP leader, model config);
    `model_dir` names the weights a disk tier's blocks belong to. Raises ValueError for a
    tier the engine cannot run (see `_make_tier`)."""
    connector = _make_transport_connector(config, runner)
    if config.cache.kv_offload_gib == 0:
        return connector
    return _make_tier(config, runner, kv, connector, model_dir)


def _make_transport_connector(config: EngineConfig, runner) -> KVConnector | None:
    kv = config.kv_transfer
    if kv.transport is None:
        return None
    from baton.engine.kv_connector.tp_ranks import TensorParallelKV
    from baton.engine.kv_connector.transport import TransportKVConnector

    size = config.parallel.tensor_parallel_size
    tp = None if size == 1 else TensorParallelKV(runner.tp_leader, 0,
                                                 runner.model_config.num_kv_heads, size)
    return TransportKVConnector(kv.transport, runner.kv_cache, kv.engine_id, kv.live, kv.host,
                                kv.port, secret=kv.secret, tp=tp)


def _make_tier(config: EngineConfig, runner, kv: KVCacheManager, inner: KVConnector | None,
               model_dir: Path) -> KVConnector:
    """The host tier of `kv_offload_gib` GiB over the runner's KV cache. Refused: tensor-
    parallel engines (each rank holds its own heads; the tier copies rank 0's cache only),
    models whose every layer slides a window (blocks leave a running request's table as it
    advances, and a load must fill a whole run of them), no prefix caching (nothing to
    find), and a size below one block."""
    gib = config.cache.kv_offload_gib
    if config.parallel.tensor_parallel_size != 1:
        raise ValueError(f"kv_offload_gib={gib} needs tensor_parallel_size=1 (got "
                         f"{config.parallel.tensor_parallel_size}): the host tier copies "
                         "rank 0's KV heads only")
    if kv.sliding_window is not None:
        raise ValueError(f"kv_offload_gib={gib} is not supported for a model whose every "
                         "layer attends through a sliding window")
    if not config.cache.enable_prefix_caching:
        raise ValueError(f"kv_offload_gib={gib} needs prefix caching: the tier holds "
                         "prefix-cached blocks")
    from baton.engine.kv_tier import DiskKVPool, HostKVPool, TierConnector, fingerprint

    cache = runner.kv_cache  # (layers, K/V, blocks, block_size, KVH, D)
    block_bytes = cache[:, :, 0].numel() * cache.element_size()
    num_blocks = int(gib * _GIB) // block_bytes
    if num_blocks < 1:
        raise ValueError(f"kv_offload_gib={gib} holds no KV block ({block_bytes} bytes each)")
    disk = None
    if config.cache.kv_disk_dir is not None:
        disk_gib = config.cache.kv_disk_gib
        if int(disk_gib * _GIB) // block_bytes < 1:
            raise ValueError(f"kv_disk_gib={disk_gib} holds no KV block ({block_bytes} bytes "
                             "each)")
        disk = DiskKVPool(Path(config.cache.kv_disk_dir), fingerprint(model_dir, cache[:, :, 0]),
                          block_bytes, int(disk_gib * _GIB) // block_bytes)
    return TierConnector(kv, HostKVPool(cache, num_blocks, disk=disk), inner)
