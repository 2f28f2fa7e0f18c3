"""KVCacheManager: the one owner of sequences' KV blocks.

The scheduler decides who runs; this decides which blocks they use. It hands out blocks for
new tokens, shares cached ones (one path for registry hits, automatic hits and in-step
duplicates: full blocks by reference, a partial last block as a private copy), indexes every
full block a sequence has computed (prompt and output alike, so a chat's next turn finds the
previous answer) and takes blocks back. Reference counts live in the BlockPool and nowhere
else; nothing outside this module and the registry changes them.

Automatic prefix caching indexes blocks by a chain of content hashes (engine/block_hash.py),
as vLLM does, rather than a radix tree over token ids (SGLang): a lookup is one dict probe
per block, a block's identity needs no tree surgery when it is evicted, and the pool's free
queue already is the LRU order. What a tree would add (eviction of leaves before their
parents) comes from freeing a sequence's blocks last first. docs/architecture.md has the
longer argument.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from engine.core.sequence import Sequence
from engine.kvcache.block_hash import extend_block_hashes, scope_seed
from engine.kvcache.block_pool import BlockPool, num_blocks_for

# registry: a whole registered prefix; registry-partial: its full blocks before the prompt
# diverged; auto: blocks computed earlier in the prompt's own scope; batch: an in-step leader.
HitSource = Literal["registry", "registry-partial", "auto", "batch"]


@dataclass(frozen=True, slots=True)
class CacheHit:
    """Computed tokens a sequence can start from: `num_tokens` of `block_ids` (full blocks
    shared by reference; a partial last block, if any, is copied)."""

    block_ids: list[int]
    num_tokens: int
    source: HitSource


class KVCacheManager:
    """Engine-thread only, like the pool."""

    def __init__(self, pool: BlockPool, enable_auto_cache: bool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_auto_cache = enable_auto_cache
        self.num_auto_hits = 0
        self.num_auto_hit_tokens = 0
        self.num_partial_registry_hits = 0  # prompts that diverged from a registered prefix

    # -- lookups --------------------------------------------------------------------------------
    def find_cached(self, seq: Sequence) -> CacheHit | None:
        """The longest run of cached full blocks that starts `seq`, in its own cache scope."""
        if not self.enable_auto_cache:
            return None
        self.hash_blocks(seq, seq.num_tokens)
        return self.find_run(seq.block_hashes, seq.num_tokens, "auto")

    def find_run(self, hashes: list[bytes], num_tokens: int, source: HitSource) -> CacheHit | None:
        """The cached blocks of the longest run of `hashes` (a prompt's chain in some scope).
        At least the prompt's last token is left to compute: its logits give the next token."""
        max_blocks = (num_tokens - 1) // self.block_size
        block_ids: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block_id = self.pool.cached_block(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        if not block_ids:
            return None
        return CacheHit(block_ids, len(block_ids) * self.block_size, source)

    def hash_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Hash `seq`'s full blocks within its first `num_tokens` (each block once)."""
        if not seq.cache_seed:
            seq.cache_seed = scope_seed(seq.cache_salt)
        extend_block_hashes(
            seq.block_hashes, seq.token_ids, num_tokens, self.block_size, seq.cache_seed
        )

    # -- sharing --------------------------------------------------------------------------------
    def can_share(self, hit: CacheHit) -> bool:
        """A partial last block needs one free block for its private copy; full cached blocks
        that are free right now must not be the only free blocks left for that copy."""
        if hit.num_tokens % self.block_size == 0:
            return True
        revived = sum(1 for b in hit.block_ids if self.pool.ref_cnt[b] == 0)
        return self.pool.can_allocate(revived + 1)

    def share(self, seq: Sequence, hit: CacheHit) -> tuple[int, int] | None:
        """Give `seq` the hit's tokens: full blocks by reference (zero copy), a partial last
        block as a fresh private block (copy on write: the sequence writes its own tokens
        right after, inside that block, so it must never be the shared one). Precondition:
        `can_share(hit)`, `seq` holds no blocks. Returns the (src, dst) copy still to make."""
        assert not seq.block_table, "sharing into a sequence that holds blocks"
        num_full, partial = divmod(hit.num_tokens, self.block_size)
        self.pool.share(hit.block_ids[:num_full])
        seq.block_table = list(hit.block_ids[:num_full])
        seq.num_computed_tokens = hit.num_tokens
        # An automatic hit's blocks are findable in this scope already; a registry prefix's
        # (or a leader's) get this scope's hashes too once computed, so that the next turn
        # of this conversation finds them by its own chain.
        seq.num_indexed_blocks = num_full if hit.source == "auto" else 0
        if hit.source == "auto":
            self.num_auto_hits += 1
            self.num_auto_hit_tokens += hit.num_tokens
        elif hit.source == "registry-partial":
            self.num_partial_registry_hits += 1
        if not partial:
            return None
        [tail] = self.pool.allocate(1)
        seq.block_table.append(tail)
        return hit.block_ids[num_full], tail

    def copy_block(self, src: int, dst: int) -> None:
        self.pool.copy_block(src, dst)

    # -- new tokens -----------------------------------------------------------------------------
    def reserve(self, seq: Sequence, num_new: int) -> bool:
        """Blocks for `num_new` more tokens of `seq` (evicting cached free blocks if needed);
        False, and nothing taken, when the pool cannot provide them."""
        needed = num_blocks_for(seq.num_computed_tokens + num_new, self.block_size)
        missing = needed - len(seq.block_table)
        if missing <= 0:
            return True
        if not self.pool.can_allocate(missing):
            return False
        seq.block_table.extend(self.pool.allocate(missing))
        return True

    def can_allocate(self, num_blocks: int) -> bool:
        return self.pool.can_allocate(num_blocks)

    def index_computed(self, seq: Sequence) -> None:
        """Make `seq`'s newly computed full blocks findable by later prompts (after the
        forward that computed them)."""
        if not self.enable_auto_cache or seq.is_prompt_only:
            # A registry fill's blocks are findable in the registry scopes of the tenants
            # its entry names (PrefixRegistry.install), never in the default scope.
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_indexed_blocks:
            return
        self.hash_blocks(seq, num_full * self.block_size)
        for index in range(seq.num_indexed_blocks, num_full):
            self.pool.cache_block(seq.block_table[index], seq.block_hashes[index])
        seq.num_indexed_blocks = num_full

    # -- invariants -----------------------------------------------------------------------------
    def check_integrity(self, holders: Iterable[Sequence | list[int]]) -> None:
        """The pool's own invariants (free queue, pins, the hash index) and: every block's
        ref_cnt equals its number of holders (sequences, or the block lists of the other
        holders: registry prefixes, fills in flight)."""
        self.pool.check_integrity()
        tables = [h if isinstance(h, list) else h.block_table for h in holders]
        expected = Counter(b for table in tables for b in table)
        actual = Counter({b: c for b, c in enumerate(self.pool.ref_cnt) if c})
        if expected != actual:
            diff = {
                b: (actual.get(b, 0), expected.get(b, 0))
                for b in expected | actual
                if actual.get(b, 0) != expected.get(b, 0)
            }
            raise AssertionError(f"block ref_cnt != holders (block: (ref_cnt, holders)): {diff}")

    # -- giving back ----------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks, last first (its tail is evicted before its shared head)."""
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        seq.num_shared_blocks = 0
        seq.num_indexed_blocks = 0
