"""KV block hashes and adapters: an adapter's requests chain from the adapter's root, the
base model's hashes are the ones they always were (the router's `hash_token_blocks`), and
a router that knows the root (`LoadReport.lora_roots`) hashes an adapter's prompt as the
engine does."""

from __future__ import annotations

from baton.common.hashing import ROOT_HASH, hash_token_blocks, lora_root_hash
from baton.common.sampling_params import SamplingParams
from baton.engine.kv_cache import KVCacheManager
from baton.engine.lora.adapter import LoRAAdapter
from baton.engine.request import Request

PROMPT = list(range(100, 150))


def engine_hashes(lora: LoRAAdapter | None) -> list[int]:
    req = Request("r", PROMPT, SamplingParams(max_tokens=1), max_tokens=1, lora=lora)
    KVCacheManager(16, 16, True).get_computed_blocks(req)  # hashes the known tokens
    return req.block_hashes


def adapter(digest: str) -> LoRAAdapter:
    return LoRAAdapter("a", "/p", 1, digest=digest, rank=4, weights={})


def test_base_hashes_are_unchanged_and_adapters_chain_from_their_root():
    assert engine_hashes(None) == hash_token_blocks(PROMPT, 16, ROOT_HASH)
    one, other = engine_hashes(adapter("d1")), engine_hashes(adapter("d2"))
    assert one == hash_token_blocks(PROMPT, 16, lora_root_hash("d1"))
    assert len({*one} & {*engine_hashes(None)}) == 0 and len({*one} & {*other}) == 0
    assert engine_hashes(adapter("d1")) == one  # same files: same blocks, any name
