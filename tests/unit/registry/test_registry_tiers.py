"""The offload tiers through the real Redis registry: workers whose engines hold one prompt's
blocks in the device pool, the host tier and the disk tier publish each tier apart; the
router's exact index counts all of them as cached (the P/D decider), and its prefix scorer
puts the device holder first, then the host one, then the disk one, then a worker without
them; a block the disk tier lets go stops counting."""

from __future__ import annotations

import asyncio

import torch

from baton.common import registry as reg
from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_tier import DiskKVPool, HostKVPool, TierConnector
from baton.router.prefix import TIER_WEIGHTS
from baton.router.redis_discovery import RegistryDiscovery
from baton.router.scheduling.context import RoutingContext
from baton.router.scheduling.disagg import DisaggSettings
from baton.router.scheduling.scorers import SCORERS
from baton.worker.registration import Registration
from tests.unit.engine.kv_tier.test_tier_events import fill
from tests.unit.registry.test_registry import INTERVAL, report, until

BS, POOL = 4, 5
SHAPE = (1, 2, POOL, BS, 1, 2)  # (layers, K/V, blocks, block_size, KVH, D)


class Engine:
    """A worker's KV pool with the tiers under it, its blocks published to the registry."""

    def __init__(self, url: str, redis_url: str, host_blocks: int = 0, disk=None) -> None:
        self.kv = KVCacheManager(POOL, BS)
        self.tier = None if host_blocks == 0 else TierConnector(
            self.kv, HostKVPool(torch.zeros(SHAPE), host_blocks, disk=disk))
        self.reg = Registration(redis_url, url, lambda: report(), interval_s=INTERVAL,
                                flush_s=0.05)
        self.reg.attach(self.kv.pool)

    def flood(self, first_token: int) -> None:
        """A prompt that takes the whole pool, evicting what it cached."""
        fill(self.kv, f"flood{first_token}", first_token, POOL)
        if self.tier is not None:
            io = self.tier.host.io
            assert io is None or io.wait_idle(10)
            self.tier.poll()  # a step's start: the disk worker's news published


def test_the_router_weighs_each_tier_and_counts_them_all_as_cached(redis_server, tmp_path):
    async def main():
        router = RegistryDiscovery(redis_server.url)
        await router.start(None)
        block_bytes = 2 * BS * 2 * 4
        on_device = Engine("http://10.0.1.1:8001", redis_server.url)
        on_host = Engine("http://10.0.1.2:8001", redis_server.url, host_blocks=8)
        on_disk = Engine("http://10.0.1.3:8001", redis_server.url, host_blocks=1,
                         disk=DiskKVPool(tmp_path, "fp", block_bytes, 8))
        empty = Engine("http://10.0.1.4:8001", redis_server.url)
        engines = (on_device, on_host, on_disk, empty)
        prompt = [reg.hash_hex(h) for h in fill(on_device.kv, "p", 0, 4)]
        fill(on_host.kv, "p", 0, 4)
        on_host.flood(1000)  # the prompt's four blocks go to the host tier
        fill(on_disk.kv, "p", 0, 4)
        on_disk.flood(1000)  # three spill to disk, the last stays in the one-block host tier
        on_disk.flood(2000)  # the first flood's blocks push that one out: all four on disk,
        # with four of that flood's (8 files: the disk tier is full)
        for engine in engines:
            engine.reg.start()
        urls = [engine.reg.advertise_url for engine in engines]
        await until(lambda: all(url in router.endpoints for url in urls), what="joins")
        eps = [router.endpoints[url] for url in urls]
        await until(lambda: all(router.blocks.match(ep, prompt) == 4 for ep in eps[:3]),
                    what="every tier's blocks")
        tiers = [reg.DEVICE, reg.HOST, reg.DISK]
        for ep, tier in zip(eps, tiers):  # each holds the prompt in its tier only
            held = router.blocks.held[ep.worker_id]
            assert all(reg.member(h, tier) in held for h in prompt)
            assert not any(reg.member(h, t) in held for h in prompt for t in tiers if t != tier)
            assert router.blocks.weighted_match(ep, prompt) == 4 * TIER_WEIGHTS[tier]

        ctx = RoutingContext(prefix_hashes=prompt, prefix_index=router.blocks, block_tokens=BS,
                             prompt_tokens=4 * BS + 1)
        scores = SCORERS["prefix"](eps, ctx)
        assert scores[0] > scores[1] > scores[2] > scores[3] == 0.0
        settings = DisaggSettings(min_prefill_tokens=BS)
        # the P/D decider counts tier blocks as cached: one token left, a local prefill
        assert [settings.decide(ep, ctx) for ep in eps] == [False, False, False, True]

        on_disk.flood(3000)  # one more spill: the disk tier lets its oldest file go
        await until(lambda: router.blocks.match(eps[2], prompt) < 4, what="the disk drop")
        assert router.blocks.blocks_held(eps[2]) == len(
            {h for h, _ in on_disk.kv.pool.held_hashes()})
        for engine in engines:
            await engine.reg.stop()
            if engine.tier is not None:
                engine.tier.close()
        await router.stop()
    asyncio.run(main())
