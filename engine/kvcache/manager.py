"""KVCacheManager: the one owner of sequences' KV blocks, and the cache's policy.

The scheduler decides who runs and how many tokens; this decides which blocks they use. It
finds what a new sequence can start from (`match`: a whole registered prefix, a registered
prefix's blocks before the prompt diverged, blocks computed earlier in the prompt's own cache
scope, or an identical prompt admitted in this very step), shares it (`attach`: one path for
all four, full blocks by reference, a partial last block as a private copy whose timing it
decides), hands out blocks for new tokens (`allocate_slots`), indexes every full block a
sequence has computed (prompt and output alike, so a chat's next turn finds the previous
answer) and takes blocks back. Reference counts live in the BlockPool and nowhere else;
nothing outside this module and the registry changes them. The K/V data are the executor's:
block copies go to it as `BlockCopy`s in the scheduler's output.

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
from collections.abc import Sequence as Ids
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from engine.core.sequence import Sequence
from engine.kvcache.block_hash import (
    BlockHash,
    extend_block_hashes,
    registry_hashes,
    registry_seed,
    scope_seed,
)
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


class PinnedMatch(Protocol):
    """A whole pinned prefix a prompt starts with (the registry's match)."""

    @property
    def block_ids(self) -> list[int]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def last_logits(self) -> torch.Tensor: ...


class PinnedPrefixes(Protocol):
    """The prefix registry, as the cache sees it (the registry is the layer above)."""

    def match(
        self, token_ids: Ids[int], hashes: Ids[BlockHash] | None, tenant: str | None
    ) -> PinnedMatch | None: ...
    def record_lookup(self, match: PinnedMatch | None) -> None: ...


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy-on-write of a partially shared last block: `src`'s K/V into `dst`, before this
    step's forward (a block computed earlier) or after it (a block this forward fills: an
    in-step duplicate's leader's)."""

    src: int
    dst: int
    after_forward: bool = False


@dataclass(frozen=True, slots=True)
class CacheMatch:
    """What a new sequence can start from: the hit, and what comes with it."""

    hit: CacheHit
    pinned: PinnedMatch | None = None  # the registry's match, when the hit is that prefix
    leader: Sequence | None = None  # an identical prompt admitted in this step

    def exact_logits(self, seq: Sequence) -> torch.Tensor | None:
        """The stored last logits when the prompt is exactly a registered prefix (no forward)."""
        if self.pinned is None or self.hit.num_tokens != seq.num_tokens:
            return None
        return self.pinned.last_logits


# In-step deduplication key: (cache scope, prompt token ids).
_DedupKey = tuple[str | None, tuple[int, ...]]


class KVCacheManager:
    """Engine-thread only, like the pool. `prefixes`: the registry; None turns every form of
    reuse off (`--no-prefix-cache`)."""

    def __init__(
        self, pool: BlockPool, enable_auto_cache: bool, prefixes: PinnedPrefixes | None = None
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_auto_cache = enable_auto_cache
        self.prefixes = prefixes
        self.num_auto_hits = 0
        self.num_auto_hit_tokens = 0
        self.num_partial_registry_hits = 0  # prompts that diverged from a registered prefix
        self._leaders: dict[_DedupKey, Sequence] = {}  # this step's prefilled fresh prompts

    # -- matching: what a new sequence starts from ---------------------------------------------
    def begin_step(self) -> None:
        """A new schedule: prompts admitted in earlier steps are found by their blocks' hashes."""
        self._leaders.clear()

    def match(self, seq: Sequence) -> CacheMatch | None:
        """The longest computed start `seq` can share, taking nothing. An identical prompt
        admitted in this step first (prefilled once); else the longest of a whole registered
        prefix (preferred on a tie: an exact one needs no forward), a registered prefix's
        blocks before the prompt diverged, and the prompt's own scope. A request that scores
        its prompt shares nothing: every position must be computed."""
        if not self.can_reuse(seq) or seq.num_computed_tokens > 0:
            return None
        key = self._dedup_key(seq)
        leader = self._leaders.get(key) if key is not None else None
        if leader is not None:
            return CacheMatch(
                CacheHit(leader.block_table, leader.num_tokens, "batch"), None, leader
            )
        pinned, hit = self.best_cached(seq)
        if hit is None:
            return None
        return CacheMatch(hit, pinned if hit.source == "registry" else None)

    def can_reuse(self, seq: Sequence) -> bool:
        return self.prefixes is not None and seq.params.prompt_logprobs is None

    def best_cached(self, seq: Sequence) -> tuple[PinnedMatch | None, CacheHit | None]:
        """The registry's match of `seq` and the longest cached start it could share (see
        `match`); read only, so the admin API's explain can ask too."""
        assert self.prefixes is not None
        if seq.registry_chains is None:
            seeds = [registry_seed()] + ([registry_seed(seq.tenant)] if seq.tenant else [])
            seq.registry_chains = [
                registry_hashes(seq.token_ids, self.block_size, seed) for seed in seeds
            ]
        pinned = self.prefixes.match(seq.token_ids, seq.registry_chains[0], seq.tenant)
        candidates = [
            CacheHit(pinned.block_ids, pinned.num_tokens, "registry") if pinned else None,
            *(
                self.find_run(chain, seq.num_tokens, "registry-partial")
                for chain in seq.registry_chains
            ),
            self.find_cached(seq),
        ]
        hit = max(
            (c for c in candidates if c is not None), key=lambda c: c.num_tokens, default=None
        )
        return pinned, hit

    def attach(self, seq: Sequence, match: CacheMatch, copies: list[BlockCopy]) -> bool:
        """Give `seq` the match's blocks (see `share`), appending the tail block's copy to
        `copies`; False, and nothing taken, when the pool cannot hold that copy."""
        if not self.can_share(match.hit):
            return False
        tail = self.share(seq, match.hit)
        if tail is not None:  # the leader computes its tail in this step's forward
            copies.append(BlockCopy(*tail, after_forward=match.leader is not None))
        if match.leader is not None:
            seq.num_shared_blocks = match.leader.num_shared_blocks  # the registry part
            # Report what the leader got from the caches, not the leader's own prefill: the
            # duplicate's usage must read as if it had been admitted alone (no side channel).
            seq.num_cached_tokens = match.leader.num_cached_tokens
        else:
            seq.num_shared_blocks = self._num_pinned_leading(seq.block_table)
        return True

    def record_lookup(self, match: CacheMatch | None) -> None:
        """A fresh request was admitted: count its registry lookup (hit or not)."""
        if self.prefixes is not None:
            self.prefixes.record_lookup(match.pinned if match is not None else None)

    def note_admitted(self, seq: Sequence, num_new: int) -> None:
        """`seq` prefills its whole prompt in this step: later identical prompts share it."""
        key = self._dedup_key(seq)
        if key is not None and num_new == seq.num_uncomputed_tokens and num_new > 0:
            self._leaders[key] = seq

    def _dedup_key(self, seq: Sequence) -> _DedupKey | None:
        """Only fresh prompts of requests that may share dedup, within one cache scope."""
        if not self.can_reuse(seq) or seq.num_computed_tokens or seq.num_output_tokens:
            return None
        if seq.is_prompt_only:
            return None
        return seq.cache_salt, tuple(seq.token_ids)

    def _num_pinned_leading(self, block_ids: list[int]) -> int:
        """Leading blocks that belong to a registry prefix: on the torch path decodes sharing
        them are attended as a cascade group (engine/executor/attention.py)."""
        count = 0
        for block_id in block_ids:
            if not self.pool.is_pinned(block_id):
                break
            count += 1
        return count

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

    # -- new tokens -----------------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new: int) -> list[int] | None:
        """Blocks for `num_new` more tokens of `seq` (evicting cached free blocks if needed):
        the blocks added to its table (often none), or None, and nothing taken, when the pool
        cannot provide them."""
        num_tokens = seq.num_computed_tokens + num_new
        if num_tokens <= len(seq.block_table) * self.block_size:
            return []  # its blocks have room (most decode steps)
        missing = num_blocks_for(num_tokens, self.block_size) - len(seq.block_table)
        if not self.pool.can_allocate(missing):
            return None
        new_blocks = self.pool.allocate(missing)
        seq.block_table.extend(new_blocks)
        return new_blocks

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
        num_prompt_blocks = seq.num_prompt_tokens // self.block_size
        for index in range(seq.num_indexed_blocks, num_full):
            added = self.pool.cache_block(seq.block_table[index], seq.block_hashes[index])
            if added and index < num_prompt_blocks:
                seq.num_cache_written_tokens += self.block_size
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
