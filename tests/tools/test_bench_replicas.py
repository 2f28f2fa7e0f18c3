"""bench_replicas' summary: the registry hit rate and the ingress-added TTFT."""

from __future__ import annotations

from typing import Any

from tools.bench_replicas import markdown, summarize


def result(ttft_p50: float, cached: list[int], replicas: list[dict[str, Any]] | None) -> Any:
    requests = [{"status": "ok", "cached_tokens": c} for c in cached]
    summary = {
        "ttft_ms": {"p50": ttft_p50, "p95": ttft_p50 * 2},
        "tpot_ms": {"p50": 10.0},
        "e2e_ms": {"p50": 400.0, "p95": 600.0},
        "output_throughput": 25.0,
        "num_errors": 0,
    }
    listing: dict[str, Any] = {"data": [{"name": "intent-classifier", "tokens": 937}]}
    if replicas is not None:
        listing["replicas"] = replicas
    return {
        "report": {"steps": [{"summary": summary, "requests": requests}]},
        "listing": listing,
        "floor": {"models_p50_ms": 1.0, "one_token_chat_p50_ms": 30.0},
    }


def test_hit_rate_counts_requests_that_cover_the_registered_prefix() -> None:
    replicas = [{"name": "a", "lookups": 3}, {"name": "b", "lookups": 1}]
    summary = summarize(
        {
            "single-process": result(100.0, [937, 950, 937, 937], None),
            "ray-1-replica": result(112.5, [937, 12, 940, 937], replicas),
        }
    )
    rows = summary["rows"]
    assert rows["single-process"]["registry_hit_rate"] == 1.0
    assert rows["ray-1-replica"]["registry_hit_rate"] == 0.75
    assert rows["ray-1-replica"]["replica_requests"] == {"a": 3, "b": 1}
    assert summary["ingress_added_ttft_p50_ms"] == 12.5
    text = markdown(summary)
    assert "| ray-1-replica | 112.5 / 225.0 |" in text
    assert "a: 3, b: 1" in text
    assert "Ingress-added TTFT p50 (Ray, 1 replica - single process): 12.5 ms" in text


def test_no_added_ttft_without_both_configurations() -> None:
    summary = summarize({"ray-2-replicas": result(100.0, [937], [])})
    assert summary["ingress_added_ttft_p50_ms"] is None


def test_the_idle_ray_control_splits_the_added_ttft() -> None:
    summary = summarize(
        {
            "single-process": result(100.0, [937], None),
            "single-process-beside-idle-ray": result(130.0, [937], None),
            "ray-1-replica": result(145.0, [937], [{"name": "a", "lookups": 1}]),
        }
    )
    assert summary["ingress_added_ttft_p50_ms"] == 45.0
    assert summary["ray_beside_added_ttft_p50_ms"] == 30.0
    assert summary["request_path_added_ttft_p50_ms"] == 15.0
    text = markdown(summary)
    assert "of which an idle Ray beside the single process: 30.0 ms" in text
    assert "of which the request path (Ray - beside idle Ray): 15.0 ms" in text
