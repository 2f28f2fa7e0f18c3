"""PrefixIndex: the longest entry a prompt starts with, comparing only the entries that end at
one of the prompt's block boundaries (so 10,000 entries cost what one does)."""

from __future__ import annotations

import random

from engine.registry.index import PrefixIndex

BLOCK = 4


class CountingIds:
    """token_ids_of that counts how many entries a lookup compared."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, entry: tuple[int, ...]) -> tuple[int, ...]:
        self.calls += 1
        return entry


def _entries(count: int, seed: int = 0) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(1000) for _ in range(rng.randrange(1, 40))) for _ in range(count)]


def test_longest_entry_wins_and_equal_ids_match() -> None:
    entries = [(1, 2, 3), (1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 5, 6, 7, 8, 9), (9, 9)]
    index = PrefixIndex(entries, lambda e: e, BLOCK)
    assert index.longest([1, 2, 3, 4, 5, 6, 7, 0]) == (1, 2, 3, 4, 5, 6)
    assert index.longest([1, 2, 3, 4, 5, 6, 7, 8, 9]) == entries[2]
    assert index.longest([1, 2]) is None
    assert index.longest([9, 9, 9]) == (9, 9)
    assert index.longest([5]) is None
    assert len(index) == 4


def test_ten_thousand_entries_compare_only_those_at_the_prompts_boundaries() -> None:
    entries = _entries(10_000)
    counting = CountingIds()
    index = PrefixIndex(entries, counting, BLOCK)
    target = entries[5_000]
    prompt = [*target, 1001, 1002, 1003]
    counting.calls = 0
    found = index.longest(prompt)
    assert found is not None and len(found) >= len(target)
    assert prompt[: len(found)] == list(found)
    # Boundaries of a prompt of ~40 tokens: at most 11; entries ending at block 0 (shorter
    # than a block) are the only crowd: 10,000 x 3/39 of them, every other boundary ~1.
    assert counting.calls < 1_000
    slow = max((e for e in entries if prompt[: len(e)] == list(e)), key=len)
    assert found == slow


def test_a_random_sweep_agrees_with_a_linear_scan() -> None:
    rng = random.Random(7)
    stems = _entries(30, seed=1)
    entries = [stem[: rng.randrange(1, len(stem) + 1)] for stem in stems for _ in range(3)]
    index = PrefixIndex(entries, lambda e: e, BLOCK)
    for _ in range(300):
        stem = rng.choice(stems)
        prompt = [*stem[: rng.randrange(0, len(stem) + 1)], rng.randrange(1000)]
        matches = [e for e in entries if len(e) <= len(prompt) and prompt[: len(e)] == list(e)]
        expected = max(matches, key=len, default=None)
        got = index.longest(prompt)
        assert (None if got is None else len(got)) == (None if expected is None else len(expected))
