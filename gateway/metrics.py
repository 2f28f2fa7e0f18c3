"""Prometheus metrics for the gateway: request metrics it records, engine gauges read per scrape.

`GatewayMetrics` owns its own `CollectorRegistry` (never the process-global one), so several
apps, or several tests, in one process never share or clash over series.

Two kinds of series:
- request metrics (`prefixgate_requests_total`, latency histograms, token counters) are pushed
  by the gateway as requests finish;
- engine metrics (queue sizes, KV blocks, prefix hits, reload status) are pulled from one
  `EngineStats` snapshot per engine at scrape time by `_EngineCollector`, so they can never
  drift from the engine. Before the engine is ready (no snapshot) none of them are emitted.
  On Ray Serve the ingress scrapes every replica's snapshot and each series carries a
  `replica` label (one process: no such label).

Every series carries `model_name`, as vLLM's `vllm:` metrics do, so dashboards and the Gateway API
Inference Extension can select by model. Names follow Prometheus conventions (base units,
`_total` on counters); see docs/metrics.md for the full table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from engine import EngineStats, HistogramCounts

# Buckets sized for a CPU engine: prefill of a long prompt takes seconds, a decode step tens of
# milliseconds, a long completion minutes.
# fmt: off
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 180.0, 300.0)
# fmt: on

_MODEL = "model_name"
_REPLICA = "replica"


def time_per_output_token(
    e2e_seconds: float, ttft_seconds: float, num_completion_tokens: int
) -> float | None:
    """Mean inter-token latency of one request, or None when it produced fewer than 2 tokens.

    The first token's latency is TTFT; the remaining `num_completion_tokens - 1` tokens share
    the rest of the request's time.
    """
    if num_completion_tokens < 2:
        return None
    return (e2e_seconds - ttft_seconds) / (num_completion_tokens - 1)


class GatewayMetrics:
    """The gateway's metrics: recorded per request, plus engine gauges read at scrape time.

    `stats` is called once per scrape, on the scraping thread (the event loop): snapshots by
    replica name (None for the one engine of a single process), empty until it is ready.
    """

    def __init__(
        self, stats: Callable[[], Mapping[str | None, EngineStats]], model_name: str
    ) -> None:
        self.registry = CollectorRegistry()
        self._model_name = model_name
        self._requests = Counter(
            "prefixgate_requests",
            "Finished HTTP requests by route and status code.",
            [_MODEL, "route", "status"],
            registry=self.registry,
        )
        self._ttft = self._histogram(
            "prefixgate_time_to_first_token_seconds",
            "Time from request arrival to the first generated token.",
            TTFT_BUCKETS,
        )
        self._tpot = self._histogram(
            "prefixgate_time_per_output_token_seconds",
            "Mean time per output token after the first, one observation per request.",
            TPOT_BUCKETS,
        )
        self._e2e = self._histogram(
            "prefixgate_e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            E2E_BUCKETS,
        )
        self._prompt_tokens = self._counter(
            "prefixgate_prompt_tokens", "Prompt tokens of finished requests."
        )
        self._generation_tokens = self._counter(
            "prefixgate_generation_tokens", "Generated (completion) tokens of finished requests."
        )
        self._cached_tokens = self._counter(
            "prefixgate_prompt_cached_tokens",
            "Prompt tokens of finished requests served from cached (prefix) KV blocks.",
        )
        self._per_model: tuple[Counter | Histogram, ...] = (
            self._ttft,
            self._tpot,
            self._e2e,
            self._prompt_tokens,
            self._generation_tokens,
            self._cached_tokens,
        )
        for family in self._per_model:
            # Create the one series now so it is exported (at zero) before any request.
            family.labels(model_name)
        self._collector = _EngineCollector(stats, model_name)
        self.registry.register(self._collector)

    @property
    def model_name(self) -> str:
        return self._model_name

    @model_name.setter
    def model_name(self, name: str) -> None:
        """Relabel every series, e.g. once the engine has loaded and knows its model.

        Meant for start-up, before the engine serves: the latency histograms and token counters
        move to the new name and restart from zero; `prefixgate_requests_total` series already
        recorded (such as 503s while loading) keep the old name.
        """
        if name == self._model_name:
            return
        for family in self._per_model:
            family.remove(self._model_name)
            family.labels(name)
        self._model_name = self._collector.model_name = name

    def _histogram(self, name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, documentation, [_MODEL], buckets=buckets, registry=self.registry)

    def _counter(self, name: str, documentation: str) -> Counter:
        return Counter(name, documentation, [_MODEL], registry=self.registry)

    def observe_request(self, route: str, status: int) -> None:
        self._requests.labels(self._model_name, route, str(status)).inc()

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.labels(self._model_name).observe(seconds)

    def observe_tpot(self, seconds: float) -> None:
        """One observation per request; compute it with `time_per_output_token`."""
        self._tpot.labels(self._model_name).observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self._e2e.labels(self._model_name).observe(seconds)

    def observe_tokens(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int
    ) -> None:
        self._prompt_tokens.labels(self._model_name).inc(prompt_tokens)
        self._generation_tokens.labels(self._model_name).inc(completion_tokens)
        self._cached_tokens.labels(self._model_name).inc(cached_tokens)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition (format 0.0.4) and its Content-Type."""
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4


class _EngineCollector:
    """Builds the engine's metric families from one `EngineStats` snapshot per scrape.

    Engine-side totals (prefix hits, preemptions) are exported as counters: they only grow in
    the engine, and per-prefix ones restart from zero when a reload re-creates the prefix,
    which Prometheus' `rate()` treats as a counter reset.
    """

    def __init__(
        self, stats: Callable[[], Mapping[str | None, EngineStats]], model_name: str
    ) -> None:
        self._stats = stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        """Each family once, with a series per replica: Prometheus wants a family's samples
        together."""
        snaps = self._stats()
        families: dict[str, Metric] = {}
        for replica, snap in snaps.items():
            for family in self._families(snap, _Series(self.model_name, replica)):
                merged = families.setdefault(family.name, family)
                if merged is not family:
                    merged.samples.extend(family.samples)
        yield from families.values()

    def _families(self, snap: EngineStats, s: _Series) -> Iterator[Metric]:
        yield from self._load(snap, s)
        yield from self._pacing(snap, s)
        yield from self._kv_cache(snap, s)
        yield from self._prefixes(snap, s)
        yield from self._reload(snap, s)

    def _load(self, snap: EngineStats, s: _Series) -> Iterator[Metric]:
        yield s.gauge(
            "prefixgate_num_requests_running",
            "Requests in the running batch (prefill or decode).",
            snap.num_requests_running,
        )
        yield s.gauge(
            "prefixgate_num_requests_waiting",
            "Requests queued, waiting to be scheduled.",
            snap.num_requests_waiting,
        )
        yield s.counter(
            "prefixgate_num_preemptions",
            "Requests preempted (blocks freed, recomputed later) for lack of KV blocks.",
            snap.num_preemptions,
        )
        yield s.counter(
            "prefixgate_forced_tokens",
            "Output tokens a grammar forced, appended without a decode step each.",
            snap.num_forced_tokens,
        )
        yield from self._drafts(snap, s)

    def _drafts(self, snap: EngineStats, s: _Series) -> Iterator[Metric]:
        labels = [*s.labels, "prefix"]
        drafted = CounterMetricFamily(
            "prefixgate_draft_tokens",
            "Draft tokens verified by speculative decoding, by the registered prefix the "
            'request hit ("" for none).',
            labels=labels,
        )
        accepted = CounterMetricFamily(
            "prefixgate_accepted_draft_tokens",
            "Draft tokens the model agreed with: output tokens that took no decode step of "
            'their own, by the registered prefix the request hit ("" for none).',
            labels=labels,
        )
        for entry, counts in sorted(snap.draft_tokens.items()):
            drafted.add_metric(s.values(entry), counts.drafted)
            accepted.add_metric(s.values(entry), counts.accepted)
        yield drafted
        yield accepted

    def _pacing(self, snap: EngineStats, s: _Series) -> Iterator[Metric]:
        if snap.prefill_tokens_per_step is not None:
            yield s.histogram(
                "prefixgate_step_prefill_tokens",
                "Prompt tokens computed per engine step (chunks sized by --max-itl-ms beside "
                "running decodes).",
                snap.prefill_tokens_per_step,
            )
        if snap.decode_step_seconds is not None:
            yield s.histogram(
                "prefixgate_decode_step_seconds",
                "Wall time of each engine step that carried decodes: the wait every running "
                "stream saw for that token.",
                snap.decode_step_seconds,
            )

    def _kv_cache(self, snap: EngineStats, s: _Series) -> Iterator[Metric]:
        yield s.gauge(
            "prefixgate_kv_blocks_total", "KV cache blocks in the pool.", snap.num_kv_blocks
        )
        yield s.gauge("prefixgate_kv_blocks_free", "KV cache blocks free.", snap.num_free_kv_blocks)
        yield s.gauge(
            "prefixgate_kv_blocks_pinned",
            "KV cache blocks pinned by registered prefixes.",
            snap.num_pinned_kv_blocks,
        )
        yield s.gauge(
            "prefixgate_kv_blocks_cached",
            "KV cache blocks findable by content for automatic prefix caching (held or free).",
            snap.num_cached_kv_blocks,
        )
        yield s.counter(
            "prefixgate_kv_block_evictions",
            "Cached KV blocks evicted (reused for new content) by the automatic prefix cache.",
            snap.num_evicted_kv_blocks,
        )
        yield s.gauge(
            "prefixgate_kv_cache_usage_ratio",
            "Share of KV cache blocks in use, pinned prefix blocks included (0 to 1).",
            snap.kv_cache_usage_ratio,
        )
        yield s.info(
            "prefixgate_cache_config",
            "KV cache configuration, and the C++ CPU kernels' target (off: the torch paths).",
            block_size=str(snap.block_size),
            num_blocks=str(snap.num_kv_blocks),
            cpu_kernels=snap.cpu_kernels,
        )

    def _prefixes(self, snap: EngineStats, s: _Series) -> Iterator[Metric]:
        yield s.counter(
            "prefixgate_prefix_lookups",
            "Prompts checked against the prefix registry.",
            snap.prefix_lookups,
        )
        yield s.counter(
            "prefixgate_prefix_cache_hits",
            "Prompts that started with a registered prefix.",
            snap.prefix_hits,
        )
        yield s.counter(
            "prefixgate_auto_prefix_cache_hits",
            "Prompts that started from blocks the automatic prefix cache kept (earlier turns, "
            "repeats, shared starts), when those were longer than any registry match.",
            snap.auto_prefix_hits,
        )
        yield s.counter(
            "prefixgate_auto_prefix_cached_tokens",
            "Prompt tokens served from the automatic prefix cache.",
            snap.auto_prefix_cached_tokens,
        )
        hits = CounterMetricFamily(
            "prefixgate_prefix_hits",
            "Prompts that matched this registered prefix.",
            labels=[*s.labels, "prefix"],
        )
        cached = CounterMetricFamily(
            "prefixgate_prefix_cached_tokens",
            "Prompt tokens served from this prefix's pinned KV blocks.",
            labels=[*s.labels, "prefix"],
        )
        # Only prefixes in this snapshot: a prefix removed by a reload drops out of the scrape.
        for prefix in snap.prefixes:
            hits.add_metric(s.values(prefix.name), prefix.num_hits)
            cached.add_metric(s.values(prefix.name), prefix.num_cached_tokens)
        yield hits
        yield cached

    def _reload(self, snap: EngineStats, s: _Series) -> Iterator[Metric]:
        yield s.info(
            "prefixgate_prefix_registry",
            "The prefix registry being served: its digest (names, token ids, tenants).",
            digest=snap.registry_digest,
        )
        # Absent, not 0, before the first load: "never reloaded" is not "reload failed".
        if snap.last_reload_ok is not None:
            yield s.gauge(
                "prefixgate_prefix_registry_last_reload_success",
                "1 if the last prefix registry load or reload succeeded, else 0.",
                1.0 if snap.last_reload_ok else 0.0,
            )
        if snap.last_reload_time is not None:
            yield s.gauge(
                "prefixgate_prefix_registry_last_reload_timestamp_seconds",
                "Unix time of the last prefix registry load or reload.",
                snap.last_reload_time,
            )


@dataclass(frozen=True, slots=True)
class _Series:
    """The labels of one engine's series: the model, and the replica on Ray Serve."""

    model_name: str
    replica: str | None

    @property
    def labels(self) -> list[str]:
        return [_MODEL] if self.replica is None else [_MODEL, _REPLICA]

    def values(self, *extra: str) -> list[str]:
        base = [self.model_name] if self.replica is None else [self.model_name, self.replica]
        return [*base, *extra]

    def info(self, name: str, documentation: str, **labels: str) -> InfoMetricFamily:
        value = dict(zip(self.labels, self.values(), strict=True))
        return InfoMetricFamily(name, documentation, value={**value, **labels})

    def gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, documentation, labels=self.labels)
        family.add_metric(self.values(), value)
        return family

    def histogram(
        self, name: str, documentation: str, counts: HistogramCounts
    ) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, documentation, labels=self.labels)
        buckets = [
            (_bound(b), float(n)) for b, n in zip(counts.buckets, counts.counts, strict=True)
        ]
        family.add_metric(
            self.values(), [*buckets, ("+Inf", float(counts.num))], sum_value=counts.total
        )
        return family

    def counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        # The library appends `_total`: `name` must not end with it.
        family = CounterMetricFamily(name, documentation, labels=self.labels)
        family.add_metric(self.values(), value)
        return family


def _bound(bucket: float) -> str:
    """A bucket's `le` label as prometheus_client writes its own ("16.0", "0.05")."""
    return str(float(bucket))
