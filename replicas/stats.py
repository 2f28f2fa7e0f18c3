"""One EngineStats for a set of replicas: what the registry listing's totals show.

Counts add up; a prefix's hits and cached tokens add up by prefix name (every replica
registers the same entries); the digest is the replicas' common one, or "mixed" while they
disagree; the reload state is the latest one, failed if any replica's failed.
"""

from __future__ import annotations

from dataclasses import replace

from engine import DraftCounts, EngineStats, PrefixInfo

MIXED_DIGEST = "mixed"


def sum_stats(all_stats: list[EngineStats]) -> EngineStats:
    first = all_stats[0]
    digests = {s.registry_digest for s in all_stats}
    failed = [s for s in all_stats if s.last_reload_ok is False]
    times = [s.last_reload_time for s in all_stats if s.last_reload_time is not None]
    oks = [s.last_reload_ok for s in all_stats if s.last_reload_ok is not None]
    return EngineStats(
        num_requests_running=sum(s.num_requests_running for s in all_stats),
        num_requests_waiting=sum(s.num_requests_waiting for s in all_stats),
        num_kv_blocks=sum(s.num_kv_blocks for s in all_stats),
        num_free_kv_blocks=sum(s.num_free_kv_blocks for s in all_stats),
        num_pinned_kv_blocks=sum(s.num_pinned_kv_blocks for s in all_stats),
        num_cached_kv_blocks=sum(s.num_cached_kv_blocks for s in all_stats),
        num_evicted_kv_blocks=sum(s.num_evicted_kv_blocks for s in all_stats),
        auto_prefix_hits=sum(s.auto_prefix_hits for s in all_stats),
        auto_prefix_cached_tokens=sum(s.auto_prefix_cached_tokens for s in all_stats),
        block_size=first.block_size,
        num_preemptions=sum(s.num_preemptions for s in all_stats),
        num_forced_tokens=sum(s.num_forced_tokens for s in all_stats),
        draft_tokens=_sum_drafts(all_stats),
        prefix_lookups=sum(s.prefix_lookups for s in all_stats),
        prefix_hits=sum(s.prefix_hits for s in all_stats),
        prefix_cached_tokens=sum(s.prefix_cached_tokens for s in all_stats),
        prefixes=_sum_prefixes(all_stats),
        registry_digest=digests.pop() if len(digests) == 1 else MIXED_DIGEST,
        last_reload_time=max(times) if times else None,
        last_reload_ok=all(oks) if oks else None,
        last_reload_error="; ".join(s.last_reload_error or "" for s in failed) or None,
        is_reload_pending=any(s.is_reload_pending for s in all_stats),
        cpu_kernels=kernels.pop()
        if len(kernels := {s.cpu_kernels for s in all_stats}) == 1
        else "mixed",
    )


def _sum_drafts(all_stats: list[EngineStats]) -> dict[str, DraftCounts]:
    total: dict[str, DraftCounts] = {}
    for stats in all_stats:
        for entry, counts in stats.draft_tokens.items():
            seen = total.get(entry, DraftCounts())
            total[entry] = DraftCounts(
                seen.drafted + counts.drafted, seen.accepted + counts.accepted
            )
    return total


def _sum_prefixes(all_stats: list[EngineStats]) -> tuple[PrefixInfo, ...]:
    by_name: dict[str, PrefixInfo] = {}
    for stats in all_stats:
        for p in stats.prefixes:
            seen = by_name.get(p.name)
            if seen is None:
                by_name[p.name] = p
                continue
            last_hits = [t for t in (seen.last_hit_time, p.last_hit_time) if t is not None]
            by_name[p.name] = replace(
                seen,
                num_hits=seen.num_hits + p.num_hits,
                num_cached_tokens=seen.num_cached_tokens + p.num_cached_tokens,
                last_hit_time=max(last_hits) if last_hits else None,
            )
    return tuple(by_name.values())
