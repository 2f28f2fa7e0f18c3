"""sum_stats: the registry listing's totals over replicas."""

from __future__ import annotations

from dataclasses import replace

from engine import DraftCounts, EngineStats, PrefixInfo
from replicas.stats import MIXED_DIGEST, sum_stats


def prefix(name: str, hits: int, last_hit: float | None) -> PrefixInfo:
    return PrefixInfo(name, "", "chat", 64, 4, False, hits, hits * 64, last_hit)


def stats(**changes: object) -> EngineStats:
    base = EngineStats(
        num_requests_running=1,
        num_requests_waiting=2,
        num_kv_blocks=100,
        num_free_kv_blocks=60,
        num_pinned_kv_blocks=8,
        num_cached_kv_blocks=5,
        num_evicted_kv_blocks=1,
        auto_prefix_hits=3,
        auto_prefix_cached_tokens=48,
        block_size=16,
        num_preemptions=0,
        prefix_lookups=10,
        prefix_hits=7,
        prefix_cached_tokens=448,
        prefixes=(prefix("intent", 7, 100.0),),
        registry_digest="abc",
        last_reload_time=50.0,
        last_reload_ok=True,
        last_reload_error=None,
        is_reload_pending=False,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def test_counts_and_prefix_hits_add_up() -> None:
    total = sum_stats([stats(), stats(prefixes=(prefix("intent", 3, 200.0),))])
    assert (total.num_requests_running, total.num_requests_waiting) == (2, 4)
    assert (total.num_kv_blocks, total.num_free_kv_blocks) == (200, 120)
    assert (total.prefix_lookups, total.prefix_hits, total.auto_prefix_hits) == (20, 14, 6)
    [intent] = total.prefixes
    assert (intent.num_hits, intent.num_cached_tokens, intent.last_hit_time) == (10, 640, 200.0)
    assert total.registry_digest == "abc"
    assert total.kv_cache_usage_ratio == 0.4


def test_disagreeing_digests_and_a_failed_reload_show() -> None:
    total = sum_stats(
        [
            stats(),
            stats(
                registry_digest="def",
                last_reload_ok=False,
                last_reload_error="bad yaml",
                last_reload_time=90.0,
                is_reload_pending=True,
            ),
        ]
    )
    assert total.registry_digest == MIXED_DIGEST
    assert total.last_reload_ok is False
    assert total.last_reload_error == "bad yaml"
    assert total.last_reload_time == 90.0
    assert total.is_reload_pending


def test_prefixes_only_one_replica_holds_are_listed() -> None:
    total = sum_stats([stats(), stats(prefixes=(prefix("other", 1, None),))])
    assert sorted(p.name for p in total.prefixes) == ["intent", "other"]


def test_forced_and_draft_tokens_add_up_by_entry() -> None:
    one = stats(num_forced_tokens=4, draft_tokens={"intent": DraftCounts(10, 7)})
    two = stats(
        num_forced_tokens=5,
        draft_tokens={"intent": DraftCounts(3, 1), "": DraftCounts(8, 8)},
    )
    total = sum_stats([one, two])
    assert total.num_forced_tokens == 9
    assert total.draft_tokens == {"intent": DraftCounts(13, 8), "": DraftCounts(8, 8)}
