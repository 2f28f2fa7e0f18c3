"""Read-only snapshots of engine state for metrics and the admin API.

Built on whatever thread asks (the gateway's event loop): they only read ints and replace-on-
write containers (the registry swaps its dict, never mutates it), so no lock is needed and a
snapshot is at worst one step stale.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kvcache.manager import KVCacheManager
from engine.registry.registry import PrefixRegistry
from engine.registry.spec import PrefixContract
from engine.scheduler.pacing import HistogramCounts
from engine.scheduler.scheduler import Scheduler
from engine.speculative.drafter import DraftCounts


@dataclass(frozen=True, slots=True)
class PrefixInfo:
    name: str
    description: str
    kind: str
    num_tokens: int
    num_blocks: int
    is_tail_partial: bool
    num_hits: int
    num_cached_tokens: int
    last_hit_time: float | None
    contract: PrefixContract = field(default_factory=PrefixContract)
    tenants: tuple[str, ...] | None = None  # None: every tenant


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_requests_running: int
    num_requests_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_pinned_kv_blocks: int
    num_cached_kv_blocks: int  # findable by content (automatic prefix caching)
    num_evicted_kv_blocks: int  # cached blocks reused for new content, in total
    auto_prefix_hits: int
    auto_prefix_cached_tokens: int
    block_size: int
    num_preemptions: int
    prefix_lookups: int
    prefix_hits: int
    prefix_cached_tokens: int
    prefixes: tuple[PrefixInfo, ...]
    registry_digest: str  # engine.registry.registry_digest of the prefixes served
    last_reload_time: float | None
    last_reload_ok: bool | None
    last_reload_error: str | None
    is_reload_pending: bool
    # The C++ CPU kernels' target ("avx512", "avx2", "portable"), or "off": the torch paths
    cpu_kernels: str = "off"
    # Output tokens a grammar forced, appended without a decode step each (fast-forward)
    num_forced_tokens: int = 0
    # Speculative decoding: draft tokens verified and kept, per registry entry ("": none)
    draft_tokens: dict[str, DraftCounts] = field(default_factory=dict)
    # Pacing's choices (engine/scheduler/pacing.py): prompt tokens per step, and the seconds
    # of each step that carried decodes
    prefill_tokens_per_step: HistogramCounts | None = None
    decode_step_seconds: HistogramCounts | None = None

    @property
    def kv_cache_usage_ratio(self) -> float:
        """Share of blocks in use by requests or prefixes (pinned blocks count as used)."""
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks


def snapshot(
    cache: KVCacheManager,
    scheduler: Scheduler,
    registry: PrefixRegistry,
    is_reload_pending: bool,
    cpu_kernels: str,
    num_forced_tokens: int = 0,
    draft_tokens: dict[str, DraftCounts] | None = None,
) -> EngineStats:
    reload, pool = registry.last_reload, cache.pool
    return EngineStats(
        num_requests_running=sum(1 for s in list(scheduler.running) if not s.is_prompt_only),
        num_requests_waiting=sum(1 for s in list(scheduler.waiting) if not s.is_prompt_only),
        num_kv_blocks=pool.num_blocks,
        num_free_kv_blocks=pool.num_free_blocks,
        num_pinned_kv_blocks=pool.num_pinned_blocks,
        num_cached_kv_blocks=pool.num_cached_blocks,
        num_evicted_kv_blocks=pool.num_evictions,
        auto_prefix_hits=cache.num_auto_hits,
        auto_prefix_cached_tokens=cache.num_auto_hit_tokens,
        block_size=pool.block_size,
        num_preemptions=scheduler.num_preemptions,
        prefix_lookups=registry.stats.num_lookups,
        prefix_hits=registry.stats.num_hits,
        prefix_cached_tokens=registry.stats.num_cached_tokens,
        prefixes=tuple(
            PrefixInfo(
                name=p.name,
                description=p.spec.description,
                kind=p.spec.kind,
                num_tokens=p.num_tokens,
                num_blocks=len(p.block_ids),
                is_tail_partial=p.is_tail_partial,
                num_hits=p.stats.num_hits,
                num_cached_tokens=p.stats.num_cached_tokens,
                last_hit_time=p.stats.last_hit_time,
                contract=p.spec.contract,
                tenants=p.spec.tenants,
            )
            for p in registry.prefixes.values()
        ),
        registry_digest=registry.digest,
        last_reload_time=reload.time,
        last_reload_ok=reload.ok,
        last_reload_error=reload.error,
        is_reload_pending=is_reload_pending,
        cpu_kernels=cpu_kernels,
        num_forced_tokens=num_forced_tokens,
        draft_tokens=draft_tokens or {},
        prefill_tokens_per_step=scheduler.pacing.prefill_tokens.frozen(),
        decode_step_seconds=scheduler.pacing.decode_step_seconds.frozen(),
    )
