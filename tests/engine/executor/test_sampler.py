"""Sampler semantics: greedy, seeds, top-k/top-p/min-p, penalties (vs HF), logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from engine.core.errors import InvalidRequestError
from engine.core.outputs import SampleLogprobs, TokenLogprob
from engine.core.sampling_params import SamplingParams
from engine.executor.penalty_counts import TokenCounts
from engine.executor.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    add_logit_bias,
    apply_penalties,
    make_generator,
)

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)


def _logits(num_rows: int, vocab_size: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * scale  # [num_rows, vocab]


def _batch(
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    prompt_token_ids: list[list[int]] | None = None,
    output_token_ids: list[list[int]] | None = None,
    vocab_size: int = 0,
) -> SamplingBatch:
    """Penalty counts made from scratch from the rows' token lists (`vocab_size` ids)."""
    n = len(params)
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    prompts = prompt_token_ids if prompt_token_ids is not None else [[] for _ in params]
    outputs = output_token_ids if output_token_ids is not None else [[] for _ in params]
    counts = (
        TokenCounts.of([prompts[i] for i in rows], [outputs[i] for i in rows], vocab_size, CPU)
        if rows
        else None
    )
    return SamplingBatch(params, generators if generators is not None else [None] * n, counts)


def _sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    return Sampler()(logits, batch)


def _draws(params: SamplingParams, num_draws: int = 300) -> set[int]:
    """Tokens drawn from probs [0.5, 0.3, 0.15, 0.05] on many rows, each with its own seed."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(num_draws, 4)
    generators: list[torch.Generator | None] = [make_generator(s, CPU) for s in range(num_draws)]
    return set(_sample(logits, _batch([params] * num_draws, generators)).token_ids)


def test_greedy_equals_argmax() -> None:
    logits = _logits(4, 32)
    out = _sample(logits, _batch([GREEDY] * 4))
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 4


def test_greedy_fast_path_handles_bf16() -> None:
    logits = _logits(3, 50).to(torch.bfloat16)
    out = _sample(logits, _batch([GREEDY] * 3))
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert all(isinstance(t, int) for t in out.token_ids)


def test_empty_batch() -> None:
    assert _sample(torch.empty(0, 8), _batch([])) == SamplerOutput([], [])


def test_make_generator_is_seeded() -> None:
    a = torch.rand(5, generator=make_generator(7, CPU))
    b = torch.rand(5, generator=make_generator(7, CPU))
    assert torch.equal(a, b)
    assert make_generator(7, CPU).device == CPU


def _seeded_run(extra_rows: int, num_steps: int = 20) -> list[int]:
    """Row 0 is seed 1234 at temperature 0.9; `extra_rows` other rows of every kind follow."""
    kinds = [
        GREEDY,
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.5, seed=99, top_p=0.9, logprobs=2),
        SamplingParams(temperature=1.3, min_p=0.1, presence_penalty=0.5),
    ]
    params = [SamplingParams(temperature=0.9, seed=1234)] + [
        kinds[i % len(kinds)] for i in range(extra_rows)
    ]
    generators: list[torch.Generator | None] = [
        make_generator(p.seed, CPU) if p.seed is not None else None for p in params
    ]
    tokens = []
    for step in range(num_steps):
        logits = _logits(1 + extra_rows, 16, seed=step)
        logits[0] = _logits(1, 16, seed=1000 + step)[0]  # row 0 sees the same logits every run
        outputs = [[step % 16]] * len(params)
        out = _sample(
            logits, _batch(params, generators, output_token_ids=outputs, vocab_size=logits.shape[1])
        )
        tokens.append(out.token_ids[0])
    return tokens


def test_seeded_sampling_is_reproducible_across_calls() -> None:
    first, second = _seeded_run(0), _seeded_run(0)
    assert first == second
    greedy = [_logits(1, 16, seed=1000 + step)[0].argmax().item() for step in range(20)]
    assert first != greedy  # it really samples


@pytest.mark.parametrize("extra_rows", [1, 3, 7])
def test_seeded_row_is_independent_of_the_rest_of_the_batch(extra_rows: int) -> None:
    assert _seeded_run(extra_rows) == _seeded_run(0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
        SamplingParams(temperature=2.0, top_k=1, top_p=0.5, min_p=1.0),
    ],
)
def test_degenerate_filters_equal_greedy(params: SamplingParams) -> None:
    logits = _logits(8, 64, scale=0.3)
    for seed in range(5):
        generators: list[torch.Generator | None] = [make_generator(seed, CPU), *[None] * 7]
        out = _sample(logits, _batch([params] * 8, generators))
        assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_never_samples_outside_the_top_k() -> None:
    logits = _logits(1, 50, seed=3).expand(400, 50)
    generators: list[torch.Generator | None] = [make_generator(s, CPU) for s in range(400)]
    params = [SamplingParams(temperature=2.0, top_k=5)] * 400
    out = _sample(logits, _batch(params, generators))
    assert set(out.token_ids) == set(logits[0].topk(5).indices.tolist())


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_p=0.75), {0, 1}),  # 0.5 + 0.3 is the smallest set reaching 0.75
        (SamplingParams(top_p=0.85), {0, 1, 2}),
        (SamplingParams(min_p=0.2), {0, 1, 2}),  # drops 0.05 < 0.2 * 0.5
        (SamplingParams(min_p=0.7), {0}),
        (SamplingParams(top_k=3, top_p=0.75), {0, 1}),
        (SamplingParams(top_k=2, min_p=0.7), {0}),
    ],
)
def test_filters_keep_exactly_the_expected_tokens(
    params: SamplingParams, allowed: set[int]
) -> None:
    assert _draws(params) == allowed


def test_unfiltered_sampling_reaches_every_token() -> None:
    assert _draws(SamplingParams()) == {0, 1, 2, 3}


def test_repetition_penalty_matches_hf() -> None:
    logits = torch.tensor(
        [[2.0, 1.9, -1.0, 0.5, 0.0, -3.0, 4.0], [0.3, -0.7, 1.5, 2.5, -2.0, 1.0, 0.1]]
    )
    # Every id inside the vocabulary: transformers 5.17's processor gathers them unchecked
    # (an id past the logits raised there, on the lent device's image).
    prompt_token_ids, output_token_ids = [[0, 2, 2], [3, 6]], [[5], [1, 3, 0]]
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(repetition_penalty=0.7)]
    batch = _batch(params, None, prompt_token_ids, output_token_ids, vocab_size=logits.shape[1])
    ours = apply_penalties(logits, batch)
    for row in range(2):
        ids = torch.tensor([prompt_token_ids[row] + output_token_ids[row]])
        hf = RepetitionPenaltyLogitsProcessor(params[row].repetition_penalty)
        assert torch.equal(ours[row], hf(ids, logits[row : row + 1].clone())[0])


def test_repetition_penalty_changes_the_argmax() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5]])
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    out = _sample(logits, _batch([params], None, [[0]], [[]], vocab_size=logits.shape[1]))
    assert out.token_ids == [1]  # 2.0 / 1.2 = 1.667 < 1.9
    hf = RepetitionPenaltyLogitsProcessor(1.2)(torch.tensor([[0]]), logits.clone())
    assert out.token_ids == hf.argmax(dim=-1).tolist()


def test_presence_and_frequency_penalties_exact_values() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 0.5, -1.0], [1.0, 2.0, 3.0, 4.0, 0.5, -1.0]])
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),
    ]
    # The prompt is ignored by OpenAI penalties; the second row has none.
    batch = _batch(params, None, [[0, 0], [0]], [[1, 1, 3], [1, 1, 3]], vocab_size=logits.shape[1])
    expected = torch.tensor(
        [[1.0, 2.0 - 1.0 - 0.25, 3.0, 4.0 - 0.5 - 0.25, 0.5, -1.0], [1.0, 2.0, 3.0, 4.0, 0.5, -1.0]]
    )
    assert torch.equal(apply_penalties(logits, batch), expected)


def test_frequency_penalty_changes_the_greedy_token() -> None:
    logits = torch.tensor([[3.0, 3.5]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.5)]
    assert _sample(
        logits, _batch(params, None, [[]], [[1, 1]], vocab_size=logits.shape[1])
    ).token_ids == [0]
    params = [SamplingParams(temperature=0.0, presence_penalty=0.6)]
    assert _sample(
        logits, _batch(params, None, [[]], [[1, 1]], vocab_size=logits.shape[1])
    ).token_ids == [0]
    params = [SamplingParams(temperature=0.0, presence_penalty=0.4)]
    assert _sample(
        logits, _batch(params, None, [[]], [[1, 1]], vocab_size=logits.shape[1])
    ).token_ids == [1]


def _check_logprobs(entry: SampleLogprobs | None, raw: torch.Tensor, token_id: int, k: int) -> None:
    reference = torch.log_softmax(raw.float(), dim=-1)  # [vocab]
    assert entry is not None
    assert entry.token_id == token_id
    assert entry.logprob == reference[token_id].item()
    values, ids = reference.topk(k)
    assert entry.top == tuple(
        TokenLogprob(t, v) for t, v in zip(ids.tolist(), values.tolist(), strict=True)
    )
    assert [t.logprob for t in entry.top] == sorted((t.logprob for t in entry.top), reverse=True)


def test_logprobs_come_from_raw_logits() -> None:
    logits = _logits(4, 40, seed=5)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.7, logprobs=0, seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, top_k=4, repetition_penalty=1.5, logprobs=20),
    ]
    generators: list[torch.Generator | None] = [None, make_generator(1, CPU), None, None]
    out = _sample(
        logits, _batch(params, generators, [[1, 2]] * 4, [[3]] * 4, vocab_size=logits.shape[1])
    )
    assert out.logprobs[2] is None
    for row, k in [(0, 5), (1, 0), (3, 20)]:
        _check_logprobs(out.logprobs[row], logits[row], out.token_ids[row], k)
    assert out.logprobs[1] is not None and out.logprobs[1].top == ()
    assert len(out.logprobs[3].top) == 20  # type: ignore[union-attr]


def test_logprobs_from_bf16_logits() -> None:
    logits = _logits(2, 30, seed=6).to(torch.bfloat16)
    out = _sample(logits, _batch([SamplingParams(temperature=0.0, logprobs=3)] * 2))
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    for row in range(2):
        _check_logprobs(out.logprobs[row], logits[row], out.token_ids[row], 3)
    assert not math.isnan(out.logprobs[0].logprob)  # type: ignore[union-attr]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_callers_logits_are_unchanged(dtype: torch.dtype) -> None:
    logits = _logits(4, 32, seed=8).to(dtype)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=3),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, frequency_penalty=1.0),
        SamplingParams(temperature=1.0, presence_penalty=-1.0, seed=3),
        SamplingParams(temperature=1.0, logprobs=1),
    ]
    generators: list[torch.Generator | None] = [None, None, make_generator(3, CPU), None]
    _sample(
        logits,
        _batch(params, generators, [[1, 2, 3]] * 4, [[4, 4, 5]] * 4, vocab_size=logits.shape[1]),
    )
    assert torch.equal(logits, before)


def test_mixed_batch() -> None:
    logits = _logits(6, 24, seed=9)
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, seed=11),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=1.2, top_p=0.8, seed=12, logprobs=1),
        SamplingParams(temperature=0.0, presence_penalty=2.0),
    ]
    generators: list[torch.Generator | None] = [
        None,
        make_generator(11, CPU),
        None,
        None,
        make_generator(12, CPU),
        None,
    ]
    outputs = [[], [], [], [], [], [int(logits[5].argmax())]]
    out = _sample(logits, _batch(params, generators, [[]] * 6, outputs, vocab_size=logits.shape[1]))
    assert len(out.token_ids) == len(out.logprobs) == 6
    assert all(0 <= t < 24 for t in out.token_ids)
    argmax = logits.argmax(dim=-1).tolist()
    assert out.token_ids[0] == argmax[0] and out.token_ids[3] == argmax[3]
    assert out.token_ids[2] in logits[2].topk(3).indices.tolist()
    penalized = logits[5].clone()
    penalized[argmax[5]] -= 2.0
    assert out.token_ids[5] == int(penalized.argmax())
    assert [lp is not None for lp in out.logprobs] == [False, False, False, True, True, False]


# -- the C++ argmax (engine/executor/kernels/sampling_ops.cpp) -------------------------------


@pytest.fixture(scope="module")
def kernel_ops() -> None:
    from engine.core.config import default_cache_dir
    from engine.executor.kernels import load_cpu_kernels

    assert load_cpu_kernels(default_cache_dir()), "the C++ kernels did not build"


def _crafted_rows(vocab: int) -> torch.Tensor:
    """Rows whose argmax is decided by ties, the tail past the last full vector, NaN, infinities
    and signed zeros; the rest random."""
    gen = torch.Generator().manual_seed(vocab)
    rows = torch.randn(12, vocab, generator=gen)
    rows[0, [3, vocab - 1]] = 9.0  # a tie: the first wins
    rows[1, vocab - 1] = 9.0  # the maximum in the tail (or the only lane)
    rows[2, [vocab // 2, 5]] = float("nan")  # the first NaN, wherever the maximum is
    rows[2, 0] = float("inf")
    rows[3, vocab - 1] = float("nan")  # a NaN in the tail only
    rows[4] = float("-inf")  # every entry the same: index 0
    rows[5] = -1.0
    rows[5, [vocab - 1, vocab // 3]] = 0.0
    rows[5, vocab // 3] = -0.0  # -0.0 == +0.0: the first of the two
    rows[6, [vocab // 4, vocab // 4 + 1]] = float("inf")
    rows[7] = 0.0
    return rows


@pytest.mark.usefixtures("kernel_ops")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [7, 8, 33, 49152, 49155])
def test_kernel_argmax_is_torch_argmax(dtype: torch.dtype, vocab: int) -> None:
    rows = _crafted_rows(vocab).to(dtype)
    expected = rows.argmax(dim=-1)
    for count in (1, 5, rows.shape[0]):  # one row alone, and rows split over threads
        got = torch.ops.prefixgate.argmax_rows(rows[:count])
        assert got.dtype == torch.long
        assert got.tolist() == expected[:count].tolist()
    # a non-contiguous view (a column slice) reads the same values
    wide = torch.cat([rows, rows], dim=1)[:, :vocab]
    assert torch.ops.prefixgate.argmax_rows(wide).tolist() == expected.tolist()


@pytest.mark.usefixtures("kernel_ops")
def test_sampler_on_the_kernel_argmax_picks_what_torch_picks() -> None:
    """Greedy, seeded and mixed batches: the same ids either way (the exponential race's
    argmax included), in bf16 logits as the engine computes them here."""
    logits = _logits(9, 49152, seed=3).to(torch.bfloat16)
    params = [
        GREEDY,
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.0, top_k=40, seed=2),
        GREEDY,
        SamplingParams(temperature=0.7, top_p=0.9, seed=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=1.2, min_p=0.05, seed=4),
        SamplingParams(temperature=0.9, seed=5),
        GREEDY,
    ]

    def run(sampler: Sampler, rows: list[int]) -> list[int]:
        chosen = [params[i] for i in rows]
        generators: list[torch.Generator | None] = [
            make_generator(p.seed, CPU) if p.seed is not None else None for p in chosen
        ]
        batch = _batch(
            chosen, generators, output_token_ids=[[1, 2, 3]] * len(rows), vocab_size=49152
        )
        return sampler(logits[rows], batch).token_ids

    for rows in ([0, 3, 8], list(range(9)), [1, 2, 4, 6, 7]):
        assert run(Sampler(use_cpu_kernels=True), rows) == run(Sampler(), rows)


def test_logit_bias_adds_to_its_own_row_only() -> None:
    logits = _logits(3, 50).to(torch.bfloat16)
    params = [
        SamplingParams(logit_bias=((4, -100.0), (9, 2.5))),
        GREEDY,
        SamplingParams(logit_bias=((4, 1.25),)),
    ]
    biased = add_logit_bias(logits.clone(), params)
    widened = logits.float()  # bf16 widened exactly, then the bias added in float32
    assert biased.dtype == torch.float32
    expected = widened.clone()
    expected[0, 4] -= 100.0
    expected[0, 9] += 2.5
    expected[2, 4] += 1.25
    assert torch.equal(biased, expected)
    assert torch.equal(biased[1], widened[1])  # an unbiased row keeps its values


def test_no_logit_bias_is_the_callers_tensor() -> None:
    logits = _logits(2, 10)
    assert add_logit_bias(logits, [GREEDY, GREEDY]) is logits


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        (((3, 100.5),), "logit_bias values must be in"),
        (((3, -101.0),), "logit_bias values must be in"),
        (((3, 1.0), (3, 2.0)), "logit_bias keys must be distinct token ids"),
        (((-1, 1.0),), "logit_bias keys must be distinct token ids"),
    ],
)
def test_bad_logit_bias_is_an_invalid_request(
    bias: tuple[tuple[int, float], ...], message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message) as info:
        SamplingParams(logit_bias=bias)
    assert info.value.param == "logit_bias"
