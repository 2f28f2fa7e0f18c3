"""The paged KV cache's blocks: ids with reference counts, pins and content hashes (the K/V
tensors themselves are the executor's, engine/executor/kv_cache.py).

Ownership rules: a block is free (ref_cnt 0, in the free queue) or referenced (ref_cnt >= 1).
Every holder of a block (a running sequence, a registry prefix) owns one reference and gives
it back with `free()`. Pinned blocks are referenced blocks that a long-lived holder (the prefix
registry) keeps; they are never handed out or evicted while pinned.

Automatic prefix caching: a full block may be known by content hashes (engine/block_hash.py;
one per cache scope that computed or used it). A freed block keeps its KV and its hashes: it
stays findable by `cached_block()` and can be shared again (`share()` takes it back out of
the free queue) until the pool needs it. The free queue is the eviction order: blocks freed
without hashes go to its front (handed out first, they hold nothing anyone can find), hashed
blocks to its back, so the least recently freed cached block is evicted first; `allocate()`
forgets the hashes of the blocks it hands out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.kvcache.block_hash import BlockHash


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the per-layer K/V tensors."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


class BlockPool:
    """Block ids and their bookkeeping for a KV cache of `num_blocks` blocks shaped by `spec`."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        self.ref_cnt = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}  # content hash -> the block holding it
        self._hashes: dict[int, list[BlockHash]] = {}  # block -> its hashes (cached blocks)
        self.num_evictions = 0  # cached blocks handed out for new content
        # Fresh blocks are handed out in id order: every block below this was handed out at
        # least once (the executor zeroes the K/V of those it has not seen, KVCache.zero_fresh).
        self.num_touched = 0
        self._pinned: dict[int, int] = {}  # block_id -> number of pins

    # -- allocation ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._pinned)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by content (referenced or not)."""
        return len(self._hashes)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks, each with ref_cnt 1. Caller checks `can_allocate`."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"KV pool exhausted: want {num_blocks}, have {len(self._free)}")
        block_ids = [self._free.popitem(last=False)[0] for _ in range(num_blocks)]
        for block_id in block_ids:
            self.ref_cnt[block_id] = 1
            self._evict(block_id)
        self.num_touched = max(self.num_touched, max(block_ids, default=-1) + 1)
        return block_ids

    def share(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on blocks someone else holds, or on cached free blocks
        (zero-copy sharing; a cached free block leaves the free queue)."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                assert block_id in self._hashes, f"sharing free uncached block {block_id}"
                del self._free[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Give back one reference per block; a block whose count drops to 0 is free again
        (a cached one stays findable until it is evicted). Free a sequence's blocks last
        first: its tail, the least likely to be shared, is then evicted first."""
        for block_id in block_ids:
            assert self.ref_cnt[block_id] > 0, f"double free of block {block_id}"
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                assert block_id not in self._pinned, f"pinned block {block_id} freed"
                self._free[block_id] = None
                if block_id not in self._hashes:
                    self._free.move_to_end(block_id, last=False)

    # -- content hashes (automatic prefix caching) ------------------------------------------------
    def cache_block(self, block_id: int, block_hash: BlockHash, replace: bool = False) -> bool:
        """Make a full, computed block findable by `block_hash`. If another block holds that
        content already, it keeps it, unless `replace` (a pinned registry block must stay
        findable; the other copy would be evicted some day). True when the hash found no
        block before: content the cache did not hold."""
        holder = self._cached.get(block_hash)
        if holder == block_id or (holder is not None and not replace):
            return False
        if holder is not None:
            self._hashes[holder].remove(block_hash)
            if not self._hashes[holder]:
                del self._hashes[holder]
        self._cached[block_hash] = block_id
        self._hashes.setdefault(block_id, []).append(block_hash)
        return holder is None

    def uncache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """`block_hash` no longer finds `block_id` (if it did; another holder of that hash
        keeps it). The block itself, its references and its other hashes are untouched."""
        if self._cached.get(block_hash) != block_id:
            return
        del self._cached[block_hash]
        self._hashes[block_id].remove(block_hash)
        if not self._hashes[block_id]:
            del self._hashes[block_id]

    def cached_block(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def cached_by_recency(self) -> list[tuple[int, list[BlockHash]]]:
        """Unpinned cached blocks and their hashes, most recently used first: those still
        referenced (in no particular order among themselves; none at a graceful stop), then
        the free ones from the back of the free queue (the KV snapshots' hot set)."""
        held = [b for b in self._hashes if self.ref_cnt[b] > 0 and b not in self._pinned]
        free = [b for b in reversed(self._free) if b in self._hashes]
        return [(b, list(self._hashes[b])) for b in held + free]

    def _evict(self, block_id: int) -> None:
        hashes = self._hashes.pop(block_id, None)
        if hashes is None:
            return
        for block_hash in hashes:
            del self._cached[block_hash]
        self.num_evictions += 1

    # -- pinning (the prefix registry's long-lived references) ----------------------------------
    def pin(self, block_ids: Sequence[int]) -> None:
        """Mark referenced blocks as pinned; the pinning holder keeps its own reference."""
        for block_id in block_ids:
            assert self.ref_cnt[block_id] > 0, f"pinning free block {block_id}"
            self._pinned[block_id] = self._pinned.get(block_id, 0) + 1

    def unpin(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            count = self._pinned[block_id] - 1
            if count:
                self._pinned[block_id] = count
            else:
                del self._pinned[block_id]

    def is_pinned(self, block_id: int) -> bool:
        return block_id in self._pinned

    # -- invariants -----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """free + referenced == total; no negative counts; free blocks unreferenced, unpinned;
        the hash index and each block's hashes agree."""
        free = set(self._free)
        for block_id, count in enumerate(self.ref_cnt):
            if count < 0:
                raise AssertionError(f"block {block_id} has ref_cnt {count}")
            if (count == 0) != (block_id in free):
                raise AssertionError(f"block {block_id}: ref_cnt {count}, free={block_id in free}")
        for block_id in self._pinned:
            if self.ref_cnt[block_id] == 0:
                raise AssertionError(f"pinned block {block_id} is unreferenced")
        indexed = {(h, b) for h, b in self._cached.items()}
        listed = {(h, b) for b, hashes in self._hashes.items() for h in hashes}
        if indexed != listed:
            raise AssertionError(f"hash index and block hashes differ: {indexed ^ listed}")


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
