"""Pacing: how many prompt tokens a step may compute so that running decodes keep their pace.

A fixed token budget lets one step carry a whole budget of prompt tokens beside every running
decode. On a 2-core AVX2 CPU a 128-token chunk takes ~400 ms, and every stream then waits that
long for its next token: at 3 intent requests/s the inter-token latency's p95 was 455 ms
against 38 ms alone, which is what broke a 2 s end-to-end target long before the CPU was
busy. With a target (`--max-itl-ms`), each step that carries decodes gets only the prompt
tokens that fit in what the target leaves after the decodes, as Sarathi-Serve's stall-free
batching sizes its chunks, and the rest of a prompt goes in the next steps. A step that
carries no decode keeps the whole token budget (nobody waits on it), and every step computes
at least `min_prefill_tokens` of a waiting prompt, so new requests are never starved: their
first token is late by a bounded number of steps, never postponed without end.

What a chunk costs comes from `StepCostModel`, fitted on this machine's own steps as the
engine serves them: a step's seconds ~ a + b * tokens + c * keys + d * rows, `keys` being the
sum over the step's queries of the positions they attend to (attention's work), `rows` the
positions whose logits are computed (the head's work). Until it has seen
enough steps the model does not limit anything. The choices are counted for /metrics: prompt
tokens per step, and the seconds of each step that carried decodes (the delay every running
stream saw).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Buckets of the two histograms /metrics shows.
PREFILL_TOKEN_BUCKETS = (0, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
DECODE_STEP_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


def attention_keys(start: int, num_new: int) -> int:
    """Keys read by `num_new` queries at positions start..start + num_new - 1 (causal)."""
    return num_new * start + num_new * (num_new + 1) // 2


_NUM_FEATURES = 4


@dataclass(slots=True)
class StepCostModel:
    """Recursive least squares over (1, tokens, keys / 1000, logits rows) -> seconds, with
    forgetting, so it follows a machine whose speed drifts (other load, frequency scaling).
    Logits rows (one per sampling sequence, plus one per draft token verified) pay the
    model's head besides the layers: a draft row costs more than a prompt token."""

    forgetting: float = 0.98
    min_observations: int = 8
    num_observations: int = 0
    theta: list[float] = field(default_factory=lambda: [0.0] * _NUM_FEATURES)
    p: list[list[float]] = field(
        default_factory=lambda: [
            [1e3 if i == j else 0.0 for j in range(_NUM_FEATURES)] for i in range(_NUM_FEATURES)
        ]
    )

    @property
    def is_ready(self) -> bool:
        return self.num_observations >= self.min_observations

    def observe(self, tokens: int, keys: int, seconds: float, rows: int = 0) -> None:
        n = _NUM_FEATURES
        x = _features(tokens, keys, rows)
        px = [sum(self.p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denominator = self.forgetting + sum(x[i] * px[i] for i in range(n))
        gain = [v / denominator for v in px]
        error = seconds - sum(t * v for t, v in zip(self.theta, x, strict=True))
        self.theta = [t + g * error for t, g in zip(self.theta, gain, strict=True)]
        self.p = [
            [(self.p[i][j] - gain[i] * px[j]) / self.forgetting for j in range(n)] for i in range(n)
        ]
        # Steps alike (a steady decode batch) teach nothing new in some directions, and
        # forgetting would then grow their variance without end: keep it bounded.
        for i in range(n):
            if self.p[i][i] > _MAX_VARIANCE:
                shrink = (_MAX_VARIANCE / self.p[i][i]) ** 0.5
                for j in range(n):
                    self.p[i][j] *= shrink
                    self.p[j][i] *= shrink
        self.num_observations += 1

    def seconds(self, tokens: int, keys: int, rows: int = 0) -> float:
        """The predicted step time (each term taken at no less than zero)."""
        x = _features(tokens, keys, rows)
        return sum(max(t, 0.0) * v for t, v in zip(self.theta, x, strict=True))

    def marginal(self, tokens: int, keys: int, rows: int = 0) -> float:
        """What `tokens` more tokens reading `keys` more keys (`rows` of them with logits)
        add to a step."""
        return self.seconds(tokens, keys, rows) - max(self.theta[0], 0.0)


_MAX_VARIANCE = 1e3


def _features(tokens: int, keys: int, rows: int) -> list[float]:
    return [1.0, float(tokens), keys / 1000.0, float(rows)]


@dataclass(frozen=True, slots=True)
class HistogramCounts:
    """A histogram as /metrics shows it: `counts[i]` counts the values <= `buckets[i]`."""

    buckets: tuple[float, ...]
    counts: tuple[int, ...]
    total: float  # the sum of the values
    num: int


@dataclass(slots=True)
class Histogram:
    """Cumulative bucket counts (Prometheus style: `counts[i]` counts values <= buckets[i])."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    num: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.num += 1

    def frozen(self) -> HistogramCounts:
        return HistogramCounts(self.buckets, tuple(self.counts), self.total, self.num)


@dataclass(slots=True)
class Pacing:
    """The policy. `max_itl` None: a fixed token budget, as before (no limit from time)."""

    max_itl: float | None  # seconds
    min_prefill_tokens: int
    cost: StepCostModel = field(default_factory=StepCostModel)
    prefill_tokens: Histogram = field(default_factory=lambda: Histogram(PREFILL_TOKEN_BUCKETS))
    decode_step_seconds: Histogram = field(
        default_factory=lambda: Histogram(DECODE_STEP_SECONDS_BUCKETS)
    )
    num_cut_chunks: int = 0  # prompt chunks made shorter than the token budget allowed

    @property
    def is_on(self) -> bool:
        """A target is set: the cost model is fitted and chunks are sized by it."""
        return self.max_itl is not None

    def time_left(self, num_decodes: int, decode_keys: int) -> float | None:
        """Seconds the step's prompt chunks may take after its decodes; None: no limit (no
        target, a model not fitted yet, or no decode to keep waiting)."""
        if self.max_itl is None or num_decodes == 0 or not self.cost.is_ready:
            return None
        return self.max_itl - self.cost.seconds(num_decodes, decode_keys, num_decodes)

    def chunk(self, time_left: float | None, start: int, wanted: int, prefilled: int) -> int:
        """Prompt tokens from position `start` (at most `wanted`) that fit in `time_left`,
        given `prefilled` prompt tokens already in the step; at least `min_prefill_tokens`
        per step in all."""
        if time_left is None:
            return wanted
        floor = max(self.min_prefill_tokens - prefilled, 0)
        lo, hi = 0, wanted  # the largest k whose marginal cost fits: costs grow with k
        while lo < hi:
            k = (lo + hi + 1) // 2
            if self.cost.marginal(k, attention_keys(start, k)) <= time_left:
                lo = k
            else:
                hi = k - 1
        chunk = min(max(lo, floor), wanted)
        self.num_cut_chunks += chunk < wanted
        return chunk

    def spent(self, time_left: float | None, start: int, num_new: int) -> float | None:
        """`time_left` after a chunk of `num_new` tokens from `start`."""
        if time_left is None:
            return None
        return time_left - self.cost.marginal(num_new, attention_keys(start, num_new))

    def count(self, num_prefill_tokens: int, has_decodes: bool, seconds: float) -> None:
        """One step's forward, timed, for /metrics (whether pacing is on or not)."""
        self.prefill_tokens.observe(num_prefill_tokens)
        if has_decodes:
            self.decode_step_seconds.observe(seconds)
