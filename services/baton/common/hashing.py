"""Chained block hashes for prefix caching.

A full block's hash covers its tokens and its parent's hash, so equal hashes mean equal whole
prefixes. The digest is stable across processes (no Python hash seed), so pods can publish
block hashes for prefix-aware routing.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    payload = struct.pack(f"<Q{len(token_ids)}I", parent_hash, *token_ids)
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def hash_token_blocks(token_ids: Sequence[int], block_size: int,
                      parent_hash: int = ROOT_HASH) -> list[int]:
    """Hashes of every full block of `token_ids`, chained from `parent_hash`."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start:start + block_size])
        hashes.append(parent_hash)
    return hashes


def lora_root_hash(adapter_digest: str) -> int:
    """The root a LoRA adapter's requests chain their block hashes from (the base model's
    is ROOT_HASH): the adapter's content digest hashed, so blocks never cross adapters, two
    names for the same files share them, and an adapter reloaded with other weights under
    its old name never hits its old blocks."""
    payload = b"lora:" + adapter_digest.encode()
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")
