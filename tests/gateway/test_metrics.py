"""GatewayMetrics: exact exposition lines, scrape-time engine gauges, isolated registries.

Engine snapshots are built by hand (`EngineStats` / `PrefixInfo` are frozen dataclasses); no
engine or model is loaded.
"""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from engine import DraftCounts, EngineStats, HistogramCounts, PrefixInfo
from gateway.metrics import (
    E2E_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    GatewayMetrics,
    time_per_output_token,
)

MODEL = "tiny-llama"
M = f'model_name="{MODEL}"'

ENGINE_FAMILIES = {
    "prefixgate_num_requests_running",
    "prefixgate_step_prefill_tokens",
    "prefixgate_decode_step_seconds",
    "prefixgate_num_requests_waiting",
    "prefixgate_num_preemptions",
    "prefixgate_forced_tokens",
    "prefixgate_draft_tokens",
    "prefixgate_accepted_draft_tokens",
    "prefixgate_kv_blocks_total",
    "prefixgate_kv_blocks_free",
    "prefixgate_kv_blocks_pinned",
    "prefixgate_kv_blocks_cached",
    "prefixgate_kv_block_evictions",
    "prefixgate_kv_cache_usage_ratio",
    "prefixgate_cache_config_info",
    "prefixgate_prefix_lookups",
    "prefixgate_prefix_cache_hits",
    "prefixgate_auto_prefix_cache_hits",
    "prefixgate_auto_prefix_cached_tokens",
    "prefixgate_prefix_hits",
    "prefixgate_prefix_cached_tokens",
    "prefixgate_prefix_registry_info",
    "prefixgate_prefix_registry_last_reload_success",
    "prefixgate_prefix_registry_last_reload_timestamp_seconds",
}
REQUEST_FAMILIES = {
    "prefixgate_requests",
    "prefixgate_time_to_first_token_seconds",
    "prefixgate_time_per_output_token_seconds",
    "prefixgate_e2e_request_latency_seconds",
    "prefixgate_prompt_tokens",
    "prefixgate_generation_tokens",
    "prefixgate_prompt_cached_tokens",
}


def _prefix(name: str, num_hits: int, num_cached_tokens: int) -> PrefixInfo:
    return PrefixInfo(
        name=name,
        description=f"{name} prompt",
        kind="messages",
        num_tokens=40,
        num_blocks=3,
        is_tail_partial=True,
        num_hits=num_hits,
        num_cached_tokens=num_cached_tokens,
        last_hit_time=None,
    )


SYS = _prefix("sys", num_hits=5, num_cached_tokens=200)
DOC = _prefix("doc", num_hits=2, num_cached_tokens=64)
SNAP = EngineStats(
    num_requests_running=3,
    num_requests_waiting=2,
    num_kv_blocks=64,
    num_free_kv_blocks=48,
    num_pinned_kv_blocks=6,
    num_cached_kv_blocks=20,
    num_evicted_kv_blocks=4,
    auto_prefix_hits=3,
    auto_prefix_cached_tokens=96,
    block_size=16,
    num_preemptions=1,
    num_forced_tokens=12,
    draft_tokens={"sys": DraftCounts(40, 31), "": DraftCounts(9, 2)},
    prefix_lookups=9,
    prefix_hits=7,
    prefix_cached_tokens=264,
    prefixes=(SYS, DOC),
    registry_digest="0123456789abcdef",
    last_reload_time=1700000000.5,
    last_reload_ok=True,
    last_reload_error=None,
    is_reload_pending=False,
    cpu_kernels="avx2",
    prefill_tokens_per_step=HistogramCounts((16, 128), (3, 5), 400.0, 6),
    decode_step_seconds=HistogramCounts((0.05, 0.15), (2, 7), 0.9, 8),
)


def _text(metrics: GatewayMetrics) -> str:
    return metrics.render()[0].decode()


def _families(metrics: GatewayMetrics) -> dict[str, str]:
    """Family name -> type, without the `_created` gauges prometheus_client adds."""
    return {
        f.name: f.type
        for f in text_string_to_metric_families(_text(metrics))
        if not f.name.endswith("_created")
    }


def _samples(metrics: GatewayMetrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Sample labels (sorted, model_name included) -> value, for one sample name."""
    return {
        tuple(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(_text(metrics))
        for s in f.samples
        if s.name == name
    }


def _one(snap: EngineStats | None) -> dict[str | None, EngineStats]:
    """A single engine's snapshots, as the gateway hands them over (none before it is ready)."""
    return {} if snap is None else {None: snap}


def _metrics(snap: EngineStats | None = SNAP) -> GatewayMetrics:
    return GatewayMetrics(stats=lambda: _one(snap), model_name=MODEL)


def test_render_content_type_is_prometheus_text_0_0_4() -> None:
    _, content_type = _metrics().render()
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"


@pytest.mark.parametrize(
    "line",
    [
        "# TYPE prefixgate_num_requests_running gauge",
        f"prefixgate_num_requests_running{{{M}}} 3.0",
        f"prefixgate_num_requests_waiting{{{M}}} 2.0",
        "# TYPE prefixgate_kv_blocks_total gauge",
        f"prefixgate_kv_blocks_total{{{M}}} 64.0",
        f"prefixgate_kv_blocks_free{{{M}}} 48.0",
        f"prefixgate_kv_blocks_pinned{{{M}}} 6.0",
        f"prefixgate_kv_cache_usage_ratio{{{M}}} 0.25",
        f"prefixgate_kv_blocks_cached{{{M}}} 20.0",
        "# TYPE prefixgate_kv_block_evictions_total counter",
        f"prefixgate_kv_block_evictions_total{{{M}}} 4.0",
        f"prefixgate_auto_prefix_cache_hits_total{{{M}}} 3.0",
        f"prefixgate_auto_prefix_cached_tokens_total{{{M}}} 96.0",
        "# TYPE prefixgate_num_preemptions_total counter",
        f"prefixgate_num_preemptions_total{{{M}}} 1.0",
        "# TYPE prefixgate_forced_tokens_total counter",
        f"prefixgate_forced_tokens_total{{{M}}} 12.0",
        "# TYPE prefixgate_draft_tokens_total counter",
        f'prefixgate_draft_tokens_total{{{M},prefix="sys"}} 40.0',
        f'prefixgate_draft_tokens_total{{{M},prefix=""}} 9.0',
        "# TYPE prefixgate_accepted_draft_tokens_total counter",
        f'prefixgate_accepted_draft_tokens_total{{{M},prefix="sys"}} 31.0',
        f'prefixgate_accepted_draft_tokens_total{{{M},prefix=""}} 2.0',
        "# TYPE prefixgate_prefix_lookups_total counter",
        f"prefixgate_prefix_lookups_total{{{M}}} 9.0",
        f"prefixgate_prefix_cache_hits_total{{{M}}} 7.0",
        "# TYPE prefixgate_prefix_hits_total counter",
        f'prefixgate_prefix_hits_total{{{M},prefix="sys"}} 5.0',
        f'prefixgate_prefix_hits_total{{{M},prefix="doc"}} 2.0',
        f'prefixgate_prefix_cached_tokens_total{{{M},prefix="sys"}} 200.0',
        f'prefixgate_prefix_cached_tokens_total{{{M},prefix="doc"}} 64.0',
        "# TYPE prefixgate_cache_config_info gauge",
        f'prefixgate_cache_config_info{{block_size="16",cpu_kernels="avx2",{M},num_blocks="64"}}'
        " 1.0",
        "# TYPE prefixgate_prefix_registry_info gauge",
        f'prefixgate_prefix_registry_info{{digest="0123456789abcdef",{M}}} 1.0',
        f"prefixgate_prefix_registry_last_reload_success{{{M}}} 1.0",
        f"prefixgate_prefix_registry_last_reload_timestamp_seconds{{{M}}} 1.7000000005e+09",
        "# TYPE prefixgate_step_prefill_tokens histogram",
        f'prefixgate_step_prefill_tokens_bucket{{le="16.0",{M}}} 3.0',
        f'prefixgate_step_prefill_tokens_bucket{{le="128.0",{M}}} 5.0',
        f'prefixgate_step_prefill_tokens_bucket{{le="+Inf",{M}}} 6.0',
        f"prefixgate_step_prefill_tokens_count{{{M}}} 6.0",
        f"prefixgate_step_prefill_tokens_sum{{{M}}} 400.0",
        "# TYPE prefixgate_decode_step_seconds histogram",
        f'prefixgate_decode_step_seconds_bucket{{le="0.05",{M}}} 2.0',
        f'prefixgate_decode_step_seconds_bucket{{le="0.15",{M}}} 7.0',
        f'prefixgate_decode_step_seconds_bucket{{le="+Inf",{M}}} 8.0',
        f"prefixgate_decode_step_seconds_count{{{M}}} 8.0",
        f"prefixgate_decode_step_seconds_sum{{{M}}} 0.9",
    ],
)
def test_engine_metrics_exact_lines(line: str) -> None:
    assert line in _text(_metrics()).splitlines()


def test_no_doubled_total_suffix() -> None:
    assert "_total_total" not in _text(_metrics())


def test_families_and_types() -> None:
    counters = {
        "prefixgate_requests",
        "prefixgate_prompt_tokens",
        "prefixgate_generation_tokens",
        "prefixgate_prompt_cached_tokens",
        "prefixgate_num_preemptions",
        "prefixgate_forced_tokens",
        "prefixgate_draft_tokens",
        "prefixgate_accepted_draft_tokens",
        "prefixgate_prefix_lookups",
        "prefixgate_prefix_cache_hits",
        "prefixgate_auto_prefix_cache_hits",
        "prefixgate_auto_prefix_cached_tokens",
        "prefixgate_kv_block_evictions",
        "prefixgate_prefix_hits",
        "prefixgate_prefix_cached_tokens",
    }
    histograms = {
        "prefixgate_step_prefill_tokens",
        "prefixgate_decode_step_seconds",
        "prefixgate_time_to_first_token_seconds",
        "prefixgate_time_per_output_token_seconds",
        "prefixgate_e2e_request_latency_seconds",
    }
    expected = {name: "gauge" for name in ENGINE_FAMILIES | REQUEST_FAMILIES}
    expected |= {name: "counter" for name in counters}
    expected |= {name: "histogram" for name in histograms}
    assert _families(_metrics()) == expected


def test_every_sample_carries_model_name() -> None:
    metrics = _metrics()
    metrics.observe_request("/v1/chat/completions", 200)
    for family in text_string_to_metric_families(_text(metrics)):
        for sample in family.samples:
            assert sample.labels["model_name"] == MODEL, sample.name


def test_none_stats_emits_request_metrics_only() -> None:
    metrics = _metrics(None)
    metrics.observe_request("/v1/completions", 200)
    assert set(_families(metrics)) == REQUEST_FAMILIES


def test_stats_read_at_every_scrape() -> None:
    snap: list[EngineStats | None] = [None]
    metrics = GatewayMetrics(stats=lambda: _one(snap[0]), model_name=MODEL)
    assert _samples(metrics, "prefixgate_num_requests_waiting") == {}
    snap[0] = SNAP
    assert _samples(metrics, "prefixgate_num_requests_waiting") == {(("model_name", MODEL),): 2.0}
    snap[0] = dataclasses.replace(SNAP, num_requests_waiting=0, num_free_kv_blocks=64)
    assert _samples(metrics, "prefixgate_num_requests_waiting") == {(("model_name", MODEL),): 0.0}
    assert _samples(metrics, "prefixgate_kv_cache_usage_ratio") == {(("model_name", MODEL),): 0.0}


def test_prefix_labels_follow_the_snapshot() -> None:
    snap = [SNAP]
    metrics = GatewayMetrics(stats=lambda: _one(snap[0]), model_name=MODEL)
    assert _samples(metrics, "prefixgate_prefix_hits_total") == {
        (("model_name", MODEL), ("prefix", "doc")): 2.0,
        (("model_name", MODEL), ("prefix", "sys")): 5.0,
    }
    snap[0] = dataclasses.replace(SNAP, prefixes=(SYS,))
    assert _samples(metrics, "prefixgate_prefix_hits_total") == {
        (("model_name", MODEL), ("prefix", "sys")): 5.0,
    }
    assert _samples(metrics, "prefixgate_prefix_cached_tokens_total") == {
        (("model_name", MODEL), ("prefix", "sys")): 200.0,
    }
    assert 'prefix="doc"' not in _text(metrics)


def test_no_prefixes_keeps_global_prefix_counters() -> None:
    metrics = _metrics(dataclasses.replace(SNAP, prefixes=()))
    assert _samples(metrics, "prefixgate_prefix_hits_total") == {}
    assert _samples(metrics, "prefixgate_prefix_lookups_total") == {(("model_name", MODEL),): 9.0}


def test_reload_metrics_absent_before_first_load() -> None:
    metrics = _metrics(dataclasses.replace(SNAP, last_reload_time=None, last_reload_ok=None))
    families = _families(metrics)
    assert "prefixgate_prefix_registry_last_reload_success" not in families
    assert "prefixgate_prefix_registry_last_reload_timestamp_seconds" not in families


def test_failed_reload_is_zero() -> None:
    failed = dataclasses.replace(SNAP, last_reload_ok=False, last_reload_error="bad yaml")
    lines = _text(_metrics(failed)).splitlines()
    assert f"prefixgate_prefix_registry_last_reload_success{{{M}}} 0.0" in lines


def test_request_counter_labels() -> None:
    metrics = _metrics()
    metrics.observe_request("/v1/chat/completions", 200)
    metrics.observe_request("/v1/chat/completions", 200)
    metrics.observe_request("/v1/chat/completions", 400)
    metrics.observe_request("/v1/completions", 200)
    chat = (("model_name", MODEL), ("route", "/v1/chat/completions"))
    assert _samples(metrics, "prefixgate_requests_total") == {
        (*chat, ("status", "200")): 2.0,
        (*chat, ("status", "400")): 1.0,
        (("model_name", MODEL), ("route", "/v1/completions"), ("status", "200")): 1.0,
    }
    line = f'prefixgate_requests_total{{{M},route="/v1/chat/completions",status="400"}} 1.0'
    assert line in _text(metrics).splitlines()


def test_token_counters() -> None:
    metrics = _metrics()
    metrics.observe_tokens(prompt_tokens=100, completion_tokens=8, cached_tokens=64)
    metrics.observe_tokens(prompt_tokens=20, completion_tokens=4, cached_tokens=0)
    lines = _text(metrics).splitlines()
    assert f"prefixgate_prompt_tokens_total{{{M}}} 120.0" in lines
    assert f"prefixgate_generation_tokens_total{{{M}}} 12.0" in lines
    assert f"prefixgate_prompt_cached_tokens_total{{{M}}} 64.0" in lines


def test_request_series_exported_before_any_request() -> None:
    lines = _text(_metrics()).splitlines()
    assert f"prefixgate_prompt_tokens_total{{{M}}} 0.0" in lines
    assert f"prefixgate_time_to_first_token_seconds_count{{{M}}} 0.0" in lines
    # The labelled request counter has no series until a request finishes.
    assert _samples(_metrics(), "prefixgate_requests_total") == {}


def test_histogram_counts_sums_and_buckets() -> None:
    metrics = _metrics()
    for seconds in (0.25, 0.5, 2.0):
        metrics.observe_ttft(seconds)
    metrics.observe_e2e(4.0)
    metrics.observe_tpot(0.125)
    model = (("model_name", MODEL),)
    ttft = "prefixgate_time_to_first_token_seconds"
    assert _samples(metrics, f"{ttft}_count") == {model: 3.0}
    assert _samples(metrics, f"{ttft}_sum") == {model: 2.75}
    buckets = _samples(metrics, f"{ttft}_bucket")
    assert buckets[(("le", "0.1"), *model)] == 0.0
    assert buckets[(("le", "0.25"), *model)] == 1.0
    assert buckets[(("le", "0.5"), *model)] == 2.0
    assert buckets[(("le", "2.5"), *model)] == 3.0
    assert buckets[(("le", "+Inf"), *model)] == 3.0
    assert _samples(metrics, "prefixgate_e2e_request_latency_seconds_sum") == {model: 4.0}
    assert _samples(metrics, "prefixgate_time_per_output_token_seconds_count") == {model: 1.0}
    assert _samples(metrics, "prefixgate_time_per_output_token_seconds_sum") == {model: 0.125}


@pytest.mark.parametrize(
    ("name", "buckets", "lowest", "highest"),
    [
        ("prefixgate_time_to_first_token_seconds", TTFT_BUCKETS, 0.01, 60.0),
        ("prefixgate_time_per_output_token_seconds", TPOT_BUCKETS, 0.005, 5.0),
        ("prefixgate_e2e_request_latency_seconds", E2E_BUCKETS, 0.05, 300.0),
    ],
)
def test_histogram_buckets(
    name: str, buckets: tuple[float, ...], lowest: float, highest: float
) -> None:
    assert (buckets[0], buckets[-1]) == (lowest, highest)
    assert list(buckets) == sorted(set(buckets))
    bounds = [labels[0][1] for labels in _samples(_metrics(), f"{name}_bucket")]
    assert bounds == [str(b) for b in buckets] + ["+Inf"]


def test_instances_do_not_share_state() -> None:
    first = GatewayMetrics(stats=lambda: _one(SNAP), model_name="a")
    second = GatewayMetrics(stats=lambda: {}, model_name="b")
    first.observe_request("/v1/completions", 200)
    first.observe_ttft(1.0)
    assert _samples(second, "prefixgate_requests_total") == {}
    assert _samples(second, "prefixgate_time_to_first_token_seconds_count") == {
        (("model_name", "b"),): 0.0
    }
    assert "prefixgate_num_requests_running" not in _families(second)
    assert first.registry is not second.registry


def test_global_registry_untouched() -> None:
    _metrics().observe_request("/v1/completions", 200)
    assert REGISTRY.get_sample_value("prefixgate_requests_total") is None
    assert all(not f.name.startswith("prefixgate") for f in REGISTRY.collect())


@pytest.mark.parametrize(
    ("e2e", "ttft", "num_completion_tokens", "expected"),
    [
        (2.5, 0.5, 5, 0.5),
        (1.5, 0.5, 2, 1.0),
        (0.5, 0.5, 1, None),
        (0.0, 0.0, 0, None),
    ],
)
def test_time_per_output_token(
    e2e: float, ttft: float, num_completion_tokens: int, expected: float | None
) -> None:
    assert time_per_output_token(e2e, ttft, num_completion_tokens) == expected


def test_rename_model_moves_series_and_engine_gauges() -> None:
    metrics = GatewayMetrics(stats=lambda: _one(SNAP), model_name="loading")
    metrics.observe_request("/v1/chat/completions", 503)
    metrics.model_name = MODEL
    metrics.observe_ttft(0.5)
    assert _samples(metrics, "prefixgate_time_to_first_token_seconds_count") == {
        (("model_name", MODEL),): 1.0
    }
    assert _samples(metrics, "prefixgate_prompt_tokens_total") == {(("model_name", MODEL),): 0.0}
    assert _samples(metrics, "prefixgate_num_requests_running") == {(("model_name", MODEL),): 3.0}
    # Requests already counted keep the name they were served under.
    assert _samples(metrics, "prefixgate_requests_total") == {
        (("model_name", "loading"), ("route", "/v1/chat/completions"), ("status", "503")): 1.0
    }


def test_rename_to_same_name_keeps_values() -> None:
    metrics = _metrics()
    metrics.observe_tokens(prompt_tokens=3, completion_tokens=2, cached_tokens=0)
    metrics.model_name = MODEL
    assert _samples(metrics, "prefixgate_prompt_tokens_total") == {(("model_name", MODEL),): 3.0}


def test_replicas_get_a_replica_label_and_each_family_appears_once() -> None:
    """Ray Serve: one snapshot per replica, each series labelled with its replica."""
    other = dataclasses.replace(SNAP, num_requests_waiting=5, registry_digest="other")
    metrics = GatewayMetrics(stats=lambda: {"r1": SNAP, "r2": other}, model_name=MODEL)
    text = _text(metrics)
    assert text.count("# TYPE prefixgate_num_requests_waiting gauge") == 1
    assert _samples(metrics, "prefixgate_num_requests_waiting") == {
        (("model_name", MODEL), ("replica", "r1")): 2.0,
        (("model_name", MODEL), ("replica", "r2")): 5.0,
    }
    assert _samples(metrics, "prefixgate_prefix_hits_total") == {
        (("model_name", MODEL), ("prefix", "doc"), ("replica", r)): 2.0 for r in ("r1", "r2")
    } | {(("model_name", MODEL), ("prefix", "sys"), ("replica", r)): 5.0 for r in ("r1", "r2")}
    digests = _samples(metrics, "prefixgate_prefix_registry_info")
    assert {dict(labels)["replica"]: dict(labels)["digest"] for labels in digests} == {
        "r1": SNAP.registry_digest,
        "r2": "other",
    }
