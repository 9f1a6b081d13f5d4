"""The scheduler's handle on the KV cache: which blocks each request holds.

The scheduler calls `get_computed_blocks` (prefix-cache lookup), `allocate_slots` (returns the
new blocks, or None meaning "not enough room: preempt or wait") and `free`. It never touches
the pool. Single-threaded: only the engine loop calls these.

Sliding windows: when every layer of the model attends through the same window W
(`ModelConfig.all_sliding`, Mistral v0.1 style), a query at position p reads only keys
p - W < j <= p, so a running request's blocks wholly before its next token's window are
released as it advances (vLLM's sliding-window manager does the same). The request keeps
their places in its block table: `get_block_ids` fills them with one of its live blocks,
which the window mask hides from every query. A released block goes back to the pool as any
freed block does, still findable by its hash until evicted, so prefix hits still see it.
Not released: blocks of a request whose KV is held for a puller or pulled from elsewhere
(`request.kv_handoff` set: the transfer reads or writes the whole prompt). Models that mix
sliding and global layers (Gemma 2 / 3) share one block table across layers and the global
layers read every block, so nothing is released for them: that would take a block table per
layer group (vLLM's hybrid KV manager).
"""

from __future__ import annotations

import numpy as np

from baton.common.hashing import hash_block
from baton.engine.kv_cache.block_pool import BlockPool, KVBlock
from baton.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        """`sliding_window`: the window W every layer attends through, whose out-of-window
        blocks are released (None: the model has full-attention layers; keep everything)."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"KVCacheManager sliding_window={sliding_window} must be >= 1 "
                             f"(or None)")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_caching)
        # Each request's blocks by position; None where a block fell out of the window and
        # was released (always a leading run).
        self._blocks: dict[str, list[KVBlock | None]] = {}
        # Each request's block table row (`get_block_ids`), rebuilt only when its blocks
        # change: a decode step in its last block reads it as it was (a step of a large
        # batch read every request's row, block by block, each step).
        self._rows: dict[str, np.ndarray] = {}
        self._num_hashed: dict[str, int] = {}  # blocks of the request already cached by hash

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table row; released positions hold its first live block
        (its own finite KV, which the window hides), block 0 if it has none."""
        return self.block_row(request_id).tolist()  # the caller's own: a transfer may keep it

    def block_row(self, request_id: str) -> np.ndarray:
        """`get_block_ids` as the batch builder reads it: the kept row itself (int64), to
        read at once, never to keep or change."""
        row = self._rows.get(request_id)
        if row is None:
            blocks = self._blocks.get(request_id)
            if blocks is None:
                return _NO_BLOCKS
            row = self._rows[request_id] = _row(blocks)
        return row

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (released ones not counted)."""
        return sum(1 for b in self._blocks.get(request_id, ()) if b is not None)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request's known tokens, in whole blocks, leaving at
        least one token to compute (its logits are needed). Mutates nothing in the pool."""
        if not self.enable_caching or request.skips_prefix_cache:  # prompt logprobs
            return [], 0
        self._extend_hashes(request, request.num_known_tokens)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    # -- mutations -------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None,
                       publish: bool = True) -> list[KVBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `new_computed_blocks` are prefix-cache hits taken at admission. Returns the newly
        allocated blocks, or None when the pool cannot hold them (nothing changed, except
        that blocks already out of a sliding window may have been released).
        `publish=False` keeps the new blocks out of the prefix cache (their KV arrives
        later, from another engine); `publish()` adds them once it has.
        """
        held = self._blocks.get(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens
        if (held and not new_computed_blocks and self.sliding_window is None
                and total <= len(held) * self.block_size):  # a decode in its last block
            if publish:
                self._cache_full_blocks(request, held, min(total, request.num_tokens))
            return []
        computed = new_computed_blocks or []
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_new_blocks = self.blocks_for(total_tokens) - len(held) - len(computed)
        out_of_window = self._num_out_of_window(request, num_computed)
        self._release_before(held, out_of_window)
        self._rows.pop(request.request_id, None)  # its row changes (a release, or blocks added)
        skipped = min(len(computed), max(0, out_of_window - len(held)))  # hits never taken
        taken = computed[skipped:]
        reclaimed = sum(1 for b in taken if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - reclaimed:
            return None
        self.pool.touch(taken)
        new_blocks = self.pool.allocate(max(num_new_blocks, 0))
        blocks = self._blocks.setdefault(request.request_id, held)
        blocks.extend([None] * skipped)
        blocks.extend(taken)
        blocks.extend(new_blocks)
        if publish:  # known tokens only: speculative guesses never enter the prefix cache
            self._cache_full_blocks(request, blocks, min(total_tokens, request.num_tokens))
        return new_blocks

    def publish(self, request: Request, num_tokens: int) -> None:
        """The KV of the first `num_tokens` tokens is now written: cache their full blocks."""
        self._cache_full_blocks(request, self._blocks.get(request.request_id, []), num_tokens)

    def free(self, request: Request) -> None:
        """Release every block the request holds (tail first, so heads stay cached longer)."""
        blocks = self._blocks.pop(request.request_id, None)
        self._rows.pop(request.request_id, None)
        self._num_hashed.pop(request.request_id, None)
        if blocks:
            self.pool.free([b for b in reversed(blocks) if b is not None])

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def cached_blocks(self) -> list[tuple[int, int]]:
        """(block id, hash) of every findable block, the first cached first."""
        return [(b.block_id, h) for h in self.pool.cached_hashes()
                if (b := self.pool.get_cached_block(h)) is not None]

    def on_evict(self, listener, also_held=None) -> None:
        """`BlockPool.on_evict`: hear of cached blocks handed out again (the offload tier)."""
        self.pool.on_evict(listener, also_held)

    def tier_event(self, tier: str, stored: bool, block_hash: int) -> None:
        """`BlockPool.tier_event`: a tier under the pool took or let go `block_hash`."""
        self.pool.tier_event(tier, stored, block_hash)

    # -- internals -------------------------------------------------------------------------
    def _num_out_of_window(self, request: Request, num_computed: int) -> int:
        """Leading blocks no query from position `num_computed` on can see: those wholly
        before num_computed - W + 1. Zero without a window or while a transfer owns the
        request's KV."""
        if self.sliding_window is None or request.kv_handoff is not None:
            return 0
        return max(0, (num_computed - self.sliding_window + 1) // self.block_size)

    def _release_before(self, blocks: list[KVBlock | None], n: int) -> None:
        """Release blocks[:n] still held (released ones form a leading run, so walk back
        from n - 1 to it), later ones first: the least shareable are evicted first."""
        freed: list[KVBlock] = []
        for i in range(min(n, len(blocks)) - 1, -1, -1):
            block = blocks[i]
            if block is None:
                break
            freed.append(block)
            blocks[i] = None
        if freed:
            self.pool.free(freed)

    def _extend_hashes(self, request: Request, num_tokens: int) -> None:
        hashes = request.block_hashes
        bs = self.block_size
        while (len(hashes) + 1) * bs <= num_tokens:
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else request.hash_root
            hashes.append(hash_block(parent, request.token_ids(start, start + bs)))

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock | None],
                           num_tokens: int) -> None:
        """Publish blocks that will be full once this step's tokens are written. Another
        request admitted in the same step may hit them: its attention runs after this
        step's KV writes of the same layer, so that is safe. A block holding a token still
        pending (async scheduling) waits for a later step: its hash needs the token."""
        if not self.enable_caching:
            return
        num_tokens = min(num_tokens, request.num_known_tokens)
        num_full = min(num_tokens // self.block_size, len(blocks))
        start = self._num_hashed.get(request.request_id, 0)
        if num_full <= start:
            return
        self._extend_hashes(request, num_full * self.block_size)
        for i in range(start, num_full):
            block = blocks[i]
            if block is not None:  # released ones were cached before (or were hits)
                self.pool.cache_block(block, request.block_hashes[i])
        self._num_hashed[request.request_id] = num_full

    def check_integrity(self) -> None:
        """Raise AssertionError-free RuntimeError if the bookkeeping disagrees with itself:
        empty + cached + used must equal the pool size, and every block's ref count must
        equal the number of requests holding it."""
        empty, cached, used = self.pool.counts()
        if empty + cached + used != self.pool.num_blocks:
            raise RuntimeError(f"KV pool counts {empty}+{cached}+{used} != {self.pool.num_blocks}")
        refs: dict[int, int] = {}
        for blocks in self._blocks.values():
            for b in (b for b in blocks if b is not None):
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            if b.ref_cnt != refs.get(b.block_id, 0):
                raise RuntimeError(f"KV block {b.block_id} ref_cnt={b.ref_cnt} but held "
                                   f"{refs.get(b.block_id, 0)} times")
        if used != len(refs):
            raise RuntimeError(f"{used} blocks marked used but {len(refs)} held by requests")
        for rid, row in self._rows.items():
            if rid not in self._blocks or not np.array_equal(row, _row(self._blocks[rid])):
                raise RuntimeError(f"request {rid}'s block table row {row} is stale")


_NO_BLOCKS = np.empty(0, dtype=np.int64)
_NO_BLOCKS.flags.writeable = False


def _row(blocks) -> np.ndarray:
    """A block table row: each block's id, a released place its first live block's (block 0
    when none is live). Read-only: the batch builder reads it, nothing writes it."""
    live = next((b.block_id for b in blocks if b is not None), 0)
    row = np.fromiter((live if b is None else b.block_id for b in blocks), np.int64,
                      len(blocks))
    row.flags.writeable = False
    return row
