"""PrefixRegistry: operator-declared prefixes held as pinned KV blocks, matched on token ids.

Ownership: each registered prefix owns one reference (and one pin) on each of its blocks.
A request that matches takes its own reference on the prefix's full blocks (zero copy) and
gets a private copy of a partial last block, so it never writes into a shared block. When a
reload removes or replaces a prefix, the registry drops its reference and pin; requests still
holding the blocks keep them alive until they finish.

The registry is the pinned core of the prefix cache: its full blocks are also findable by
content in the registry's own hash scope (engine/prefix_index.py), so a prompt that diverges
from a registered prefix still shares every full block before the divergence, and a whole
match is found by a PrefixIndex in time that grows with the prompt, not with the registry.

Engine-thread only, like the pool.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from engine.kvcache.block_hash import BlockHash, registry_hashes, registry_seed
from engine.kvcache.block_pool import BlockPool
from engine.kvcache.manager import PinnedMatch
from engine.registry.index import PrefixIndex
from engine.registry.spec import PrefixSpec


@dataclass(slots=True)
class PrefixStats:
    num_hits: int = 0
    num_cached_tokens: int = 0  # tokens served from this prefix's blocks, summed over hits
    last_hit_time: float | None = None


@dataclass(slots=True)
class RegisteredPrefix:
    spec: PrefixSpec
    block_ids: list[int]
    last_logits: torch.Tensor  # [vocab_size], on the device: an exact hit needs no forward
    block_size: int
    stats: PrefixStats = field(default_factory=PrefixStats)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.spec.token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.spec.token_ids)

    @property
    def num_full_blocks(self) -> int:
        return self.num_tokens // self.block_size

    @property
    def is_tail_partial(self) -> bool:
        return self.num_tokens % self.block_size != 0


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A whole registered prefix a prompt starts with (the cache manager's PinnedMatch)."""

    prefix: RegisteredPrefix

    @property
    def num_tokens(self) -> int:
        return self.prefix.num_tokens

    @property
    def block_ids(self) -> list[int]:
        return self.prefix.block_ids

    @property
    def last_logits(self) -> torch.Tensor:
        return self.prefix.last_logits


@dataclass(frozen=True, slots=True)
class MatchReport:
    """Why a prompt did or did not hit: the matched prefix, else where the closest one diverged."""

    num_prompt_tokens: int
    matched: str | None
    num_matched_tokens: int
    closest: str | None = None
    diverged_at: int | None = None  # first token position where `closest` and the prompt differ
    prefix_token_id: int | None = None  # the prefix's token there
    prompt_token_id: int | None = None  # the prompt's token there (None: the prompt ended)
    # What admission would share now, from any source (a whole registered prefix, its blocks
    # before a divergence, or the automatic cache in the prompt's scope), and from which.
    num_cached_tokens: int = 0
    cache_source: str | None = None


@dataclass(slots=True)
class ReloadStatus:
    """Outcome of the last load/reload, for the admin API."""

    time: float | None = None
    ok: bool | None = None
    error: str | None = None
    num_prefixes: int = 0


@dataclass(slots=True)
class RegistryStats:
    num_lookups: int = 0
    num_hits: int = 0
    num_cached_tokens: int = 0


class PrefixRegistry:
    """The live set of pinned prefixes plus hit statistics."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.prefixes: dict[str, RegisteredPrefix] = {}
        self.index: PrefixIndex[RegisteredPrefix] = PrefixIndex((), _ids, pool.block_size)
        self.stats = RegistryStats()
        self.last_reload = ReloadStatus()
        self.digest = registry_digest(())

    def match(
        self,
        token_ids: Sequence[int],
        hashes: Sequence[BlockHash] | None = None,
        tenant: str | None = None,
    ) -> PrefixMatch | None:
        """Longest registered prefix whose ids start `token_ids` (equal ids included) among
        those `tenant` may hit; `hashes`: the prompt's registry_hashes, if already made."""
        best = self.index.longest(token_ids, hashes, lambda p: p.spec.visible_to(tenant))
        return PrefixMatch(best) if best is not None else None

    def explain(self, token_ids: Sequence[int], tenant: str | None = None) -> MatchReport:
        """The admin view of `match`: also finds the closest prefix that did not match
        (among those `tenant` may see: another tenant's entries are not even named)."""
        match = self.match(token_ids, tenant=tenant)
        visible = [p for p in self.prefixes.values() if p.spec.visible_to(tenant)]
        misses = [p for p in visible if match is None or p is not match.prefix]
        misses = [p for p in misses if not _starts_with(token_ids, p.token_ids)]
        report = MatchReport(
            len(token_ids), match.prefix.name if match else None, match.num_tokens if match else 0
        )
        if not misses:
            return report
        closest = max(misses, key=lambda p: _common_length(token_ids, p.token_ids))
        at = _common_length(token_ids, closest.token_ids)
        return MatchReport(
            report.num_prompt_tokens,
            report.matched,
            report.num_matched_tokens,
            closest.name,
            at,
            closest.token_ids[at],
            token_ids[at] if at < len(token_ids) else None,
        )

    def record_lookup(self, match: PinnedMatch | None) -> None:
        """Count a request's lookup (prefix fills are not counted); `match`: what `match`
        returned, when the request was served from it."""
        self.stats.num_lookups += 1
        if match is None:
            return
        assert isinstance(match, PrefixMatch)
        prefix = match.prefix
        prefix.stats.num_hits += 1
        prefix.stats.num_cached_tokens += match.num_tokens
        prefix.stats.last_hit_time = time.time()
        self.stats.num_hits += 1
        self.stats.num_cached_tokens += match.num_tokens

    def unchanged(self, spec: PrefixSpec) -> RegisteredPrefix | None:
        """The live prefix with this name and the very same token ids, if any."""
        live = self.prefixes.get(spec.name)
        return live if live is not None and live.token_ids == spec.token_ids else None

    def install(self, specs: list[PrefixSpec], ready: dict[str, RegisteredPrefix]) -> None:
        """Swap in a new set atomically: `specs` in file order, each served by `ready[name]`
        (an entry kept with the same ids takes its new spec here: the description, contract
        or tenants may be new). The registry's hold on prefixes that left the set is dropped.
        Each prefix's blocks are findable in the registry scope of each tenant that may hit
        it (or the shared one), and in no other: an entry kept with the same ids whose
        `tenants` changed, or one removed, leaves the scopes it had (else a tenant no longer
        listed, or any caller after `tenants:` was added, still found its blocks by content
        and could confirm a guess of its text through `cached_tokens`)."""
        had = {pair for p in self.prefixes.values() for pair in self._scoped_blocks(p)}
        prefixes = {s.name: ready[s.name] for s in specs if s.name in ready}
        for spec in specs:
            if spec.name in prefixes:
                prefixes[spec.name].spec = spec
        # in entry order, as the pool's replacements below take them (a dict, not a set)
        wanted = dict.fromkeys(pair for p in prefixes.values() for pair in self._scoped_blocks(p))
        for block_id, block_hash in had - wanted.keys():
            self.pool.uncache_block(block_id, block_hash)
        kept = {id(p) for p in prefixes.values()}
        for old in self.prefixes.values():
            if id(old) not in kept:
                release(self.pool, old)
        for block_id, block_hash in wanted:
            self.pool.cache_block(block_id, block_hash, replace=True)
        self.index = PrefixIndex(prefixes.values(), _ids, self.pool.block_size)
        self.prefixes = prefixes
        self.digest = registry_digest(p.spec for p in prefixes.values())

    @property
    def num_pinned_blocks(self) -> int:
        return len({b for p in self.prefixes.values() for b in p.block_ids})

    def _scoped_blocks(self, prefix: RegisteredPrefix) -> list[tuple[int, BlockHash]]:
        """(block, hash) of each full block of `prefix` in each registry scope it is in."""
        tenants = prefix.spec.tenants
        pairs: list[tuple[int, BlockHash]] = []
        for seed in [registry_seed()] if tenants is None else map(registry_seed, tenants):
            hashes = registry_hashes(prefix.token_ids, self.pool.block_size, seed)
            pairs += zip(prefix.block_ids, hashes, strict=False)
        return pairs


def registry_digest(specs: Iterable[PrefixSpec]) -> str:
    """What a registry serves, as one short hash: each entry's name, token ids and tenants,
    in name order. Two engines with the same digest answer every prompt with the same
    registry hits; replicas compare it to tell that a reload reached them all."""
    entries = sorted(
        (s.name, list(s.token_ids), None if s.tenants is None else sorted(s.tenants)) for s in specs
    )
    return hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()[:16]


def _ids(prefix: RegisteredPrefix) -> tuple[int, ...]:
    return prefix.token_ids


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _starts_with(token_ids: Sequence[int], prefix: Sequence[int]) -> bool:
    return len(prefix) <= len(token_ids) and tuple(token_ids[: len(prefix)]) == tuple(prefix)


def release(pool: BlockPool, prefix: RegisteredPrefix) -> None:
    """Give back the registry's pin and reference on a prefix's blocks."""
    pool.unpin(prefix.block_ids)
    pool.free(prefix.block_ids)
