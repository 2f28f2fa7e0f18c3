"""Turns one step's logits into one token id per row.

Semantics follow vLLM and Hugging Face: the runner adds each row's `logit_bias` and applies a
grammar's mask first (`add_logit_bias`); then penalties (repetition as in HF's
`RepetitionPenaltyLogitsProcessor`, presence/frequency as in OpenAI), then greedy argmax or
temperature -> top-k -> top-p -> min-p -> exponential-race sampling. Logprobs come from the
logits before penalties and temperature. Everything stays on the logits' device; only the
chosen ids and the requested logprobs cross to the CPU, each as one `.tolist()`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.core.outputs import SampleLogprobs, TokenLogprob
from engine.core.sampling_params import SamplingParams
from engine.executor.penalty_counts import TokenCounts


@dataclass(slots=True)
class SamplingBatch:
    """The rows that sample this step, in the same order as the logits rows.

    `generators[i]` is the row's own generator when its request has a seed, else None. The
    caller keeps a seeded request's generator across steps, so its stream of draws depends on
    nothing but the seed. `counts` holds one row per row whose params have penalties, in
    order (None when none has): the repetition penalty reads which ids the prompt or the
    output holds, frequency and presence the output's counts.
    """

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    counts: TokenCounts | None = None


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[SampleLogprobs | None]  # per row; None where params.logprobs is None


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator on `device` (noise must be drawn where the logits live) seeded with `seed`."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


Argmax = Callable[[torch.Tensor], torch.Tensor]  # [rows, vocab] -> [rows] int64


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def kernel_argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(dim=-1)'s result (first maximum, first NaN) from the C++ op
    (engine/executor/kernels/sampling_ops.cpp): torch's CPU argmax was ~1 ms of a batch-8
    decode step."""
    out: torch.Tensor = torch.ops.prefixgate.argmax_rows(logits)
    return out


class Sampler:
    """Stateless; one call per step. Never mutates the caller's logits.

    `use_cpu_kernels`: the logits are on the CPU and the C++ ops are loaded, so argmax takes
    the op (the same ids as torch's)."""

    def __init__(self, use_cpu_kernels: bool = False) -> None:
        self.argmax: Argmax = kernel_argmax if use_cpu_kernels else torch_argmax

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        # logits: [num_rows, vocab_size], any float dtype, any device
        params = batch.params
        assert logits.dim() == 2 and logits.shape[0] == len(params) == len(batch.generators)
        if all(_is_plain_greedy(p) for p in params):
            # Fast path: argmax is exact in any dtype, so no upcast and no copies.
            return SamplerOutput(self.argmax(logits).tolist(), [None] * len(params))
        # .float() returns the caller's tensor itself when it is already float32: only
        # out-of-place ops below.
        raw = logits.float()  # [num_rows, vocab_size]
        token_ids = _choose_tokens(
            apply_penalties(raw, batch), params, batch.generators, self.argmax
        )
        token_id_list: list[int] = token_ids.tolist()
        return SamplerOutput(token_id_list, _gather_logprobs(raw, token_ids, token_id_list, params))


def sampling_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled row draws from (`temperature > 0`): temperature, top-k,
    top-p, min-p, softmax, as `Sampler` applies them. `logits`: [rows, vocab] of one
    request (speculative decoding's verification rows). Float32."""
    rows = logits.shape[0]
    scaled = logits.float() / params.temperature
    scaled = _apply_min_p(_apply_top_k_top_p(scaled, [params] * rows), [params] * rows)
    return scaled.softmax(dim=-1)


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], params: SamplingParams
) -> list[SampleLogprobs]:
    """Each row's logprobs of its token as `Sampler` reports a sampled row's (rows of one
    request: the positions speculative decoding kept)."""
    raw = logits.float()
    ids = _index(token_ids, raw.device)
    result = _gather_logprobs(raw, ids, token_ids, [params] * len(token_ids))
    return [lp for lp in result if lp is not None]


def add_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """`logits` [rows, vocab] with each row's `logit_bias` added (row i's from params[i]):
    `logits` itself when no row has one, else float32 (a bf16 logit plus a bias would round
    to bf16; widening is exact, so an unbiased row keeps its values), changed in place. A
    row's values depend on its own bias only."""
    rows, ids, values = [], [], []
    for row, p in enumerate(params):
        for token_id, value in p.logit_bias:
            rows.append(row)
            ids.append(token_id)
            values.append(value)
    if not rows:
        return logits
    logits = logits.float()
    device = logits.device
    bias = torch.tensor(values, dtype=torch.float32, device=device)
    logits.index_put_((_index(rows, device), _index(ids, device)), bias, accumulate=True)
    return logits


def _is_plain_greedy(params: SamplingParams) -> bool:
    return params.is_greedy and not params.has_penalties and params.logprobs is None


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition, frequency and presence penalties, batched over the rows that use any.

    Returns `logits` itself when no row has penalties, else a new tensor; never mutates.
    """
    rows = [i for i, p in enumerate(batch.params) if p.has_penalties]
    if not rows:
        return logits
    assert batch.counts is not None and batch.counts.output.shape[0] == len(rows)
    index = _index(rows, logits.device)
    penalized = _penalize_rows(
        logits.index_select(0, index), [batch.params[i] for i in rows], batch.counts
    )
    return logits.index_copy(0, index, penalized)


def _penalize_rows(
    logits: torch.Tensor, params: list[SamplingParams], counts: TokenCounts
) -> torch.Tensor:
    # logits: [num_penalized, vocab_size], a copy we own
    device, output_counts = logits.device, counts.output  # [n, vocab_size]
    if any(p.repetition_penalty != 1.0 for p in params):
        penalty = _column([p.repetition_penalty for p in params], device)  # [n, 1]
        is_seen = counts.seen  # prompt or output, as HF applies it
        # HF: shrink toward zero from either side, so a seen token always becomes less likely.
        scaled = torch.where(logits < 0, logits * penalty, logits / penalty)
        logits = torch.where(is_seen, scaled, logits)
    if any(p.frequency_penalty != 0.0 for p in params):
        logits = logits - _column([p.frequency_penalty for p in params], device) * output_counts
    if any(p.presence_penalty != 0.0 for p in params):
        presence = _column([p.presence_penalty for p in params], device)
        logits = logits - presence * (output_counts > 0)
    return logits


def _choose_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    argmax: Argmax,
) -> torch.Tensor:
    """Argmax for greedy rows, a sample for the rest. Returns `[num_rows]` int64 on device."""
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if not rows:
        return argmax(logits)
    if len(rows) == len(params):
        return _sample(logits, params, generators, argmax)
    index = _index(rows, logits.device)
    sampled = _sample(
        logits.index_select(0, index),
        [params[i] for i in rows],
        [generators[i] for i in rows],
        argmax,
    )
    return argmax(logits).index_copy(0, index, sampled)


def _sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    argmax: Argmax,
) -> torch.Tensor:
    # logits: [num_sampled, vocab_size]; every row has temperature > 0
    logits = logits / _column([p.temperature for p in params], logits.device)
    logits = _apply_top_k_top_p(logits, params)
    logits = _apply_min_p(logits, params)
    return _exponential_race(logits.softmax(dim=-1), generators, argmax)


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """vLLM's one-sort filter: both cuts are made on the ascending sort, then scattered back.

    Top-k keeps ties with the k-th value (as HF and vLLM do). Top-p drops the tokens whose
    cumulative probability from the bottom is <= 1 - top_p, which keeps the smallest set from
    the top whose mass reaches top_p; the top token always survives.
    """
    vocab_size, device = logits.shape[1], logits.device
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    use_top_k = any(k < vocab_size for k in top_ks)
    use_top_p = any(p.top_p < 1.0 for p in params)
    if not (use_top_k or use_top_p):
        return logits
    sorted_logits, sorted_ids = logits.sort(dim=-1)  # [n, vocab_size], ascending
    if use_top_k:
        kth_index = _index([vocab_size - k for k in top_ks], device).unsqueeze(1)  # [n, 1]
        kth = sorted_logits.gather(1, kth_index)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if use_top_p:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        is_dropped = cumulative <= _column([1.0 - p.top_p for p in params], device)
        is_dropped[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(is_dropped, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def _apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Drop tokens less likely than `min_p` times the most likely one (HF `MinPLogitsWarper`)."""
    if all(p.min_p == 0.0 for p in params):
        return logits
    probs = logits.softmax(dim=-1)  # [n, vocab_size]
    threshold = _column([p.min_p for p in params], logits.device) * probs.amax(-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _exponential_race(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None], argmax: Argmax
) -> torch.Tensor:
    """argmax(probs / Exp(1) noise) is an exact draw from `probs`, with no CPU sync.

    A seeded row draws a fresh vocab-sized noise vector from its own generator, so its
    tokens depend only on its seed and its own logits, never on the other rows in the batch.
    """
    noise = torch.empty_like(probs)  # [n, vocab_size]
    if any(g is None for g in generators):
        noise.exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            own = torch.empty(probs.shape[1], device=probs.device).exponential_(generator=generator)
            noise[row] = own
    # A zero draw would make 0 / 0 = NaN for a filtered token, and argmax prefers NaN.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return argmax(probs.div(noise))


def _gather_logprobs(
    raw: torch.Tensor,
    token_ids: torch.Tensor,
    token_id_list: list[int],
    params: list[SamplingParams],
) -> list[SampleLogprobs | None]:
    """Chosen-token logprob plus top-k alternatives, from log_softmax of the raw logits."""
    result: list[SampleLogprobs | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return result
    num_top = [p.logprobs or 0 for p in (params[i] for i in rows)]
    if len(rows) < len(params):
        index = _index(rows, raw.device)
        raw, token_ids = raw.index_select(0, index), token_ids.index_select(0, index)
    logprobs = torch.log_softmax(raw, dim=-1)  # [num_rows_with_logprobs, vocab_size]
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [n, 1]
    top_values, top_ids = logprobs.topk(min(max(num_top), logprobs.shape[1]), dim=-1)
    values: list[list[float]] = torch.cat([chosen, top_values], dim=1).tolist()
    ids: list[list[int]] = top_ids.tolist()
    for j, row in enumerate(rows):
        k = num_top[j]
        top = tuple(
            TokenLogprob(t, v) for t, v in zip(ids[j][:k], values[j][1 : k + 1], strict=True)
        )
        result[row] = SampleLogprobs(token_id_list[row], values[j][0], top)
    return result


def score_tokens(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[SampleLogprobs]:
    """Each row's logprob of its token plus its top `num_top` alternatives (prompt scoring).
    `logits` is [len(token_ids), vocab_size]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab_size]
    chosen = logprobs.gather(1, _index(token_ids, logits.device).unsqueeze(1)).flatten().tolist()
    top_values, top_ids = logprobs.topk(max(num_top, 1), dim=-1)
    values, ids = top_values.tolist(), top_ids.tolist()
    return [
        SampleLogprobs(
            token_id,
            chosen[row],
            tuple(
                TokenLogprob(t, v)
                for t, v in zip(ids[row][:num_top], values[row][:num_top], strict=True)
            ),
        )
        for row, token_id in enumerate(token_ids)
    ]


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)  # [n, 1]
