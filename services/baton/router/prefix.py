"""Which KV blocks of a prompt each upstream holds: the `PrefixIndex` contract and its two
implementations, both keyed by `Upstream` and both spelling a block hash as a hex string.

A prompt is a chain of blocks, each block's hash chained to the previous one's, so a hash
names a whole prefix and `match` counts the leading blocks an upstream holds (a miss ends
the shared prefix). The `prefix` scorer prefers upstreams with long matches; the
disaggregation decider subtracts the match from the prompt before comparing it with
`min_prefill_tokens`.

- `BlockIndex` (exact): the engine's own block hashes of each worker's pool and of the
  offload tiers under it (host memory, disk: `engine.kv_tier`), mirrored from the Redis
  registry's block events (`router.redis_discovery`); the router hashes the prompt the
  engine's way (`router.tokens`). A block counts wherever the worker holds it (`match`: the
  P/D decider's cached tokens); the prefix scorer weighs it by its best tier
  (`weighted_match`, `TIER_WEIGHTS`).
- Peer fetch: with decode pods, a prefix another pod holds can be pulled rather than
  recomputed (`router.peer_fetch`); `peer_fetch_saves` is its cost model, and the prefix
  scorer values such blocks by it (`peer_fetch_value`), below any tier of the pod's own.
- `ApproximatePrefixIndex` (llm-d's "approximate" prefix-cache mode): without the registry
  or before a model's tokenizer is fetched, the prompts the router itself sent each
  upstream, cut into 64-character (or 16-token-id) blocks, about one 16-token KV block
  either way. An upstream may have evicted what the router remembers; the cost of a wrong
  guess is one local prefill of a prompt that was worth sending away, never a wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Any, Protocol

from baton.common.internal import OpenAIBody
from baton.common.protocol import ChatCompletionRequest, CompletionRequest
from baton.common.registry import DEVICE, DISK, HOST, TIERS, hash_hex, member
from baton.router.discovery import Upstream

CHARS_PER_BLOCK = 64
TOKENS_PER_BLOCK = 16
_HASH_MASK = (1 << 64) - 1  # Python's hash() is signed; a hex spelling needs it unsigned

# What a cached block is worth to the prefix scorer, by the tier that holds it: the share of
# its prefill a hit saves, 1 - (seconds to bring the block into the device pool) / (seconds
# to prefill it). Measured per 16-token block of the bundled model (bf16, its Q4_1 weights,
# one thread) on our 2-core EPYC: a prefill ~11 ms (2,048 tokens in 1.5 s), a host tier copy
# ~0.023 ms (368 KiB), a disk tier read with its BLAKE2b check ~0.30 ms (page cache warm).
# So a device hit outweighs a host hit, a host hit a disk hit, a disk hit nothing:
# 1, 0.998, 0.973, 0.
BLOCK_PREFILL_S = 11e-3
TIER_LOAD_S = {DEVICE: 0.0, HOST: 0.023e-3, DISK: 0.30e-3}
TIER_WEIGHTS = {tier: 1.0 - load_s / BLOCK_PREFILL_S for tier, load_s in TIER_LOAD_S.items()}
# A block another pod holds (`router.peer_fetch`): a tcp pull of one block (PEER_BLOCK_S) after
# a fixed cost for the fetch (PEER_FETCH_S: the router's call to the holder, its one-block
# "prefill" in its next step, the pull's handshake). Measured with `peer_fetch_bench` on our
# 2-core EPYC (bundled model, loopback tcp): a moved turn of ~2,100 tokens pulling ~110
# blocks answered 0.07 s after the same turn with the prefix in the pod's own pool.
PEER_BLOCK_S = 0.25e-3
PEER_FETCH_S = 0.05


def peer_fetch_saves(blocks: int) -> float:
    """Seconds of prefill a decode pod saves by pulling `blocks` leading blocks of a prompt
    from a peer instead of computing them (negative: pulling costs more)."""
    return blocks * (BLOCK_PREFILL_S - PEER_BLOCK_S) - PEER_FETCH_S if blocks else 0.0


def peer_fetch_value(blocks: int, block_tokens: int, min_tokens: int) -> float:
    """What pulling `blocks` blocks from a peer is worth to the prefix scorer, in blocks of
    prefill saved: 0 unless it saves at least `min_tokens` tokens and some time; always
    less than `blocks` (a pod's own copy, in any tier, is worth more)."""
    if blocks * block_tokens < max(min_tokens, 1):
        return 0.0
    return max(peer_fetch_saves(blocks), 0.0) / BLOCK_PREFILL_S


class PrefixIndex(Protocol):
    """The block hashes each upstream holds. Called on the event loop only."""

    def match(self, upstream: Upstream, hashes: Sequence[str]) -> int:
        """How many of `hashes`, from the first, `upstream` holds. Mutates nothing."""

    def weighted_match(self, upstream: Upstream, hashes: Sequence[str]) -> float:
        """Those leading blocks weighed by where `upstream` holds each (`TIER_WEIGHTS`;
        at most `match`). Mutates nothing."""

    def add(self, upstream: Upstream, hashes: Sequence[str]) -> None:
        """The router sent (or prefilled) this prompt on `upstream`: it now holds its blocks."""

    def forget(self, upstream: Upstream) -> None:
        """`upstream` failed a request: it may have restarted with an empty cache."""


def leading_matches(held: Collection[str], hashes: Sequence[str]) -> int:
    """How many of `hashes`, from the first, are in `held` (chained hashes: a miss ends
    the shared prefix)."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


# -- approximate: what the router sent ---------------------------------------------------
def prompt_of(api: str, req: OpenAIBody) -> str | list[int] | None:
    """The prompt as the router sees it, or None when a request has several prompts."""
    if api == "chat":
        assert isinstance(req, ChatCompletionRequest)  # the body of its api
        parts: list[str] = []
        for m in req.messages:
            assert m.content is not None  # a parsed ChatMessage has its content filled in
            parts.append(f"<{m.role}>" + (m.content if isinstance(m.content, str)
                                          else "".join(p.text for p in m.content)))
        return "".join(parts)
    assert isinstance(req, CompletionRequest)  # the body of its api
    prompts = req.prompts()
    return prompts[0] if len(prompts) == 1 else None


def block_hashes(prompt: str | list[int], seed: int = 0) -> list[str]:
    """The chained hashes of the prompt's whole blocks (valid within this process only:
    Python salts string hashes per process); `seed`: where the chain starts (a LoRA
    adapter's KV hash root: its prompts never match the base model's)."""
    step = CHARS_PER_BLOCK if isinstance(prompt, str) else TOKENS_PER_BLOCK
    out, prev = [], seed
    for i in range(0, len(prompt) - step + 1, step):  # whole blocks only
        prev = hash((prev, prompt[i:i + step] if isinstance(prompt, str)
                     else tuple(prompt[i:i + step])))
        out.append(hash_hex(prev & _HASH_MASK))
    return out


class ApproximatePrefixIndex:
    """A `PrefixIndex` of the prompts the router sent: an LRU of hashes per upstream URL."""

    def __init__(self, capacity_per_worker: int = 100_000) -> None:
        self.capacity = capacity_per_worker
        self._held: dict[str, OrderedDict[str, None]] = {}

    def match(self, upstream: Upstream, hashes: Sequence[str]) -> int:
        held = self._held.get(upstream.url)
        return leading_matches(held, hashes) if held else 0

    def weighted_match(self, upstream: Upstream, hashes: Sequence[str]) -> float:
        """`match`: what the router sent is taken to be in the device pool."""
        return float(self.match(upstream, hashes))

    def add(self, upstream: Upstream, hashes: Sequence[str]) -> None:
        held = self._held.setdefault(upstream.url, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def forget(self, upstream: Upstream) -> None:
        self._held.pop(upstream.url, None)


# -- exact: what the workers say they hold -----------------------------------------------
class BlockIndex:
    """A `PrefixIndex` of the engine's block hashes per worker id (the process behind an
    upstream's URL, so a restarted worker starts empty), fed by the registry's block
    events; each member names a block and its tier (`registry.member`). `add` and `forget`
    do nothing: the workers themselves say what they hold."""

    def __init__(self) -> None:
        self.held: dict[str, set[str]] = {}  # worker id -> hashes (hex)
        self.seq: dict[str, int] = {}  # worker id -> the last block event folded in

    def match(self, upstream: Upstream, hashes: Sequence[str]) -> int:
        return len(self._leading_tiers(upstream, hashes))

    def weighted_match(self, upstream: Upstream, hashes: Sequence[str]) -> float:
        return sum(TIER_WEIGHTS[tier] for tier in self._leading_tiers(upstream, hashes))

    def _leading_tiers(self, upstream: Upstream, hashes: Sequence[str]) -> list[str]:
        """The best tier of each leading block of `hashes` the worker holds somewhere."""
        held = self.held.get(upstream.worker_id, set()) if upstream.worker_id else set()
        tiers: list[str] = []
        for h in hashes if held else ():
            tier = next((t for t in TIERS if member(h, t) in held), None)
            if tier is None:
                break
            tiers.append(tier)
        return tiers

    def add(self, upstream: Upstream, hashes: Sequence[str]) -> None:
        """Nothing: the worker publishes its blocks once it has them."""

    def forget(self, upstream: Upstream) -> None:
        """Nothing: a worker that left stops heartbeating and is dropped."""

    def blocks_held(self, upstream: Upstream) -> int:
        """Distinct blocks the worker holds, in any tier."""
        held = self.held.get(upstream.worker_id, ()) if upstream.worker_id else ()
        return len({m.rpartition(":")[2] for m in held})

    def apply(self, event: dict[str, Any]) -> bool:
        """Fold a block event in; False when it skips a number (catch up from the keys)."""
        wid, seq = event["id"], int(event["seq"])
        last = self.seq.get(wid)
        if last is not None and seq <= last:
            return True  # already in the snapshot
        if not event.get("reset") and (last is None or seq != last + 1):
            return False
        held = set() if event.get("reset") else self.held.setdefault(wid, set())
        held.difference_update(event["removed"])
        held.update(event["added"])
        self.held[wid], self.seq[wid] = held, seq
        return True

    def replace(self, worker_id: str, hashes: set[str], seq: int) -> None:
        """A worker's whole set as read from the registry's keys, up to event `seq`."""
        self.held[worker_id], self.seq[worker_id] = hashes, seq

    def drop(self, worker_id: str) -> None:
        self.held.pop(worker_id, None)
        self.seq.pop(worker_id, None)
