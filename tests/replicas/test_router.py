"""rank_replicas: the preferred replica first, else two random ones (power of two choices)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from replicas.router import rank_replicas


@dataclass(frozen=True)
class _Id:
    unique_id: str


@dataclass(frozen=True)
class _Replica:
    replica_id: _Id


REPLICAS = [_Replica(_Id(name)) for name in ("a", "b", "c")]


def names(ranks: list[list[_Replica]]) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_the_preferred_replica_comes_first_and_the_others_after() -> None:
    ranks = names(rank_replicas(REPLICAS, "b", random.Random(0)))  # type: ignore[arg-type]
    assert ranks[0] == ["b"]
    assert sorted(ranks[1]) == ["a", "c"]


def test_no_preference_is_two_distinct_random_replicas() -> None:
    rng = random.Random(0)
    seen = set()
    for _ in range(50):
        [rank] = names(rank_replicas(REPLICAS, "", rng))  # type: ignore[arg-type]
        assert len(rank) == 2 and len(set(rank)) == 2
        seen.update(rank)
    assert seen == {"a", "b", "c"}


def test_a_preference_for_a_replica_that_is_gone_is_ignored() -> None:
    [rank] = names(rank_replicas(REPLICAS[:2], "c", random.Random(0)))  # type: ignore[arg-type]
    assert sorted(rank) == ["a", "b"]


def test_one_replica_alone() -> None:
    assert names(rank_replicas(REPLICAS[:1], "a")) == [["a"]]  # type: ignore[arg-type]
    assert names(rank_replicas(REPLICAS[:1], "")) == [["a"]]  # type: ignore[arg-type]
    assert rank_replicas([], "") == []
