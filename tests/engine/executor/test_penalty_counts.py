"""PenaltyCounts: counts kept between steps equal counts made from scratch, step after step."""

from __future__ import annotations

import torch

from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from engine.executor.penalty_counts import PenaltyCounts, TokenCounts

CPU = torch.device("cpu")
VOCAB = 12


def _seq(request_id: str, prompt: list[int], output: tuple[int, ...] = ()) -> Sequence:
    return Sequence(
        request_id,
        [*prompt, *output],
        len(prompt),
        SamplingParams(frequency_penalty=0.5, repetition_penalty=1.2),
        arrival_index=0,
    )


def _scratch(seqs: list[Sequence]) -> TokenCounts:
    return TokenCounts.of(
        [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs], VOCAB, CPU
    )


def _assert_equal(ours: TokenCounts, expected: TokenCounts) -> None:
    assert torch.equal(ours.output, expected.output)
    assert torch.equal(ours.seen, expected.seen)


def test_from_scratch_counts_are_the_token_histograms() -> None:
    counts = TokenCounts.of([[0, 2, 2, 30]], [[5, 5, 5, 1, 99]], VOCAB, CPU)
    expected = torch.zeros(VOCAB)
    expected[5], expected[1] = 3, 1  # 99 is past the vocabulary: ignored, as HF does
    assert torch.equal(counts.output[0], expected)
    assert counts.seen[0].nonzero().flatten().tolist() == [0, 1, 2, 5]  # prompt or output


def test_counts_kept_between_steps_equal_counts_from_scratch() -> None:
    a, b = _seq("a", [1, 2, 3, 3]), _seq("b", [4], (7, 7))
    counts = PenaltyCounts()
    _assert_equal(counts.counts([a, b], VOCAB, CPU), _scratch([a, b]))
    for step in range(6):
        a.token_ids.append((3 * step) % VOCAB)
        b.token_ids += [7, 11] if step % 2 else [2]  # several tokens since the last step too
        batch = [b, a] if step % 3 else [a, b]  # rows in any order, or only some of them
        _assert_equal(counts.counts(batch, VOCAB, CPU), _scratch(batch))
        _assert_equal(counts.counts([a], VOCAB, CPU), _scratch([a]))


def test_a_released_or_replaced_sequence_is_counted_again() -> None:
    counts = PenaltyCounts()
    first = _seq("r", [1], (2, 2, 2))
    counts.counts([first], VOCAB, CPU)
    counts.release(["r"])
    again = _seq("r", [3], (4,))  # the same id, a new request
    _assert_equal(counts.counts([again], VOCAB, CPU), _scratch([again]))
    reused = _seq("r", [5], (6, 6))  # a new sequence under the id before any release came
    _assert_equal(counts.counts([reused], VOCAB, CPU), _scratch([reused]))


def test_more_sequences_than_rows_grow_the_tables() -> None:
    seqs = [_seq(f"q{i}", [i % VOCAB, 3], (i % 5, 7)) for i in range(20)]
    counts = PenaltyCounts(num_rows=2)
    _assert_equal(counts.counts(seqs[:3], VOCAB, CPU), _scratch(seqs[:3]))
    counts.release(["q1"])
    for seq in seqs:
        seq.token_ids.append(9)
    _assert_equal(counts.counts(seqs, VOCAB, CPU), _scratch(seqs))
