"""The n-gram search drafts come from: longest suffix first, most recent occurrence, never
across a separator, never the suffix's own trailing occurrence."""

from __future__ import annotations

import numpy as np

from engine.speculative.ngram import SEPARATOR, TokenBuffer, find_continuation


def _find(history: list[int], suffix: list[int], k: int = 4, min_n: int = 2, max_n: int = 4):
    return find_continuation(np.array(history), np.array(suffix), min_n, max_n, k)


def test_the_continuation_of_the_most_recent_occurrence() -> None:
    history = [5, 6, 7, 1, 2, 9, 5, 6, 8, 3, 5, 6]
    match = _find(history, history[-2:])
    assert match is not None and match.n == 2
    assert match.continuation == [8, 3, 5, 6]  # after the second [5, 6], not the first


def test_a_longer_suffix_wins_over_a_more_recent_shorter_one() -> None:
    history = [1, 2, 3, 40, 41, 7, 2, 3, 50, 1, 2, 3]
    match = _find(history, history[-3:])
    assert match is not None and match.n == 3
    assert match.continuation == [40, 41, 7, 2]


def test_only_its_own_trailing_occurrence_is_no_match() -> None:
    assert _find([9, 8, 1, 2], [1, 2]) is None
    assert _find([1, 2, 7, 1, 2], [1, 2], k=8) is not None


def test_k_limits_and_a_separator_ends_a_continuation() -> None:
    history = [SEPARATOR, 4, 5, 6, 7, SEPARATOR, 4, 5, 1]
    match = _find(history, [0, 4, 5], k=8)
    assert match is not None and match.continuation == [1]
    match = _find([*history[:5], SEPARATOR], [4, 5], k=8)
    assert match is not None and match.continuation == [6, 7]
    match = _find(history[:5], [4, 5], k=1)
    assert match is not None and match.continuation == [6]


def test_shorter_than_min_n_is_no_match() -> None:
    assert _find([3, 1, 4, 1], [7, 1], min_n=2) is None
    match = _find([3, 1, 4, 1], [7, 1], min_n=1)
    assert match is not None and match.continuation == [4, 1]


def test_token_buffer_grows_and_drops_its_oldest() -> None:
    buffer = TokenBuffer(capacity=2)
    buffer.extend([1, 2, 3])
    buffer.extend([4])
    assert buffer.view.tolist() == [1, 2, 3, 4]
    buffer.drop_front(3)
    assert buffer.view.tolist() == [4]
    buffer.drop_front(5)
    assert buffer.size == 0
