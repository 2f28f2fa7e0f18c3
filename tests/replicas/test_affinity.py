"""AffinityTable: conversations stay on the replica that served them, unless it is overloaded."""

from __future__ import annotations

import random

from replicas.affinity import CHUNK_TOKENS, AffinityTable

REGISTRY = list(range(1000, 1000 + 100))  # a registered prefix every replica holds
LIVE = {"a", "b"}


def turn(*parts: list[int]) -> list[int]:
    return [t for part in parts for t in part]


def test_a_later_turn_prefers_the_replica_of_the_earlier_one() -> None:
    table = AffinityTable()
    first = turn(REGISTRY, list(range(80)))
    keys = table.keys(first, len(REGISTRY), None, None)
    assert table.preferred(keys, LIVE) == ""  # never seen: least-loaded
    table.started(keys, "b")
    table.finished("b")
    second = turn(first, list(range(500, 560)))
    assert table.preferred(table.keys(second, len(REGISTRY), None, None), LIVE) == "b"


def test_the_registry_prefix_alone_gives_no_affinity() -> None:
    table = AffinityTable()
    one = turn(REGISTRY, [1, 2, 3])
    table.started(table.keys(one, len(REGISTRY), None, None), "a")
    other = turn(REGISTRY, [7] * 20)  # shares only the registered prefix
    assert table.keys(other, len(REGISTRY), None, None) == []
    assert table.preferred(table.keys(other, len(REGISTRY), None, None), LIVE) == ""


def test_keys_start_at_the_first_chunk_past_the_registry_prefix() -> None:
    table = AffinityTable()
    ids = list(range(10 * CHUNK_TOKENS))
    assert len(table.keys(ids, 0, None, None)) == 10
    assert len(table.keys(ids, CHUNK_TOKENS * 3 + 1, None, None)) == 7
    assert table.keys(ids, 0, None, None)[3:] == table.keys(ids, CHUNK_TOKENS * 3, None, None)


def test_another_scope_or_tenant_never_matches() -> None:
    table = AffinityTable()
    ids = list(range(200))
    table.started(table.keys(ids, 0, "salt-1", None), "a")
    assert table.preferred(table.keys(ids, 0, "salt-1", None), LIVE) == "a"
    assert table.preferred(table.keys(ids, 0, "salt-2", None), LIVE) == ""
    assert table.preferred(table.keys(ids, 0, "salt-1", "tenant"), LIVE) == ""


def test_an_overloaded_replica_is_escaped_and_the_conversation_moves() -> None:
    table = AffinityTable(slack=2)
    ids = list(range(200))
    keys = table.keys(ids, 0, None, None)
    table.started(keys, "a")  # one in flight on a
    for _ in range(2):
        table.started([], "a")
    assert table.in_flight("a") == 3
    assert table.preferred(keys, LIVE) == ""  # 3 > 0 + 2: least-loaded instead
    table.finished("a")
    assert table.preferred(keys, LIVE) == "a"  # 2 <= 0 + 2
    table.started(keys, "b")  # served elsewhere: the keys follow
    assert table.preferred(keys, LIVE) == "b"


def test_a_replica_that_is_gone_is_not_preferred() -> None:
    table = AffinityTable()
    keys = table.keys(list(range(200)), 0, None, None)
    table.started(keys, "a")
    assert table.preferred(keys, {"b"}) == ""


def test_the_longest_known_key_wins() -> None:
    table = AffinityTable()
    short = list(range(2 * CHUNK_TOKENS))
    long = turn(short, list(range(900, 900 + 2 * CHUNK_TOKENS)))
    table.started(table.keys(short, 0, None, None), "a")
    table.started(table.keys(long, 0, None, None), "b")
    table.finished("a")
    table.finished("b")
    assert table.preferred(table.keys(long, 0, None, None), LIVE) == "b"
    # `short`'s own keys were overwritten by `long` (it starts the same): b holds them too.
    assert table.preferred(table.keys(short, 0, None, None), LIVE) == "b"


def test_capacity_drops_the_least_recently_used_keys() -> None:
    table = AffinityTable(capacity=4)
    old = table.keys(list(range(4 * CHUNK_TOKENS)), 0, None, None)
    table.started(old, "a")
    new = table.keys(list(range(50_000, 50_000 + 2 * CHUNK_TOKENS)), 0, None, None)
    table.started(new, "b")
    assert table.preferred(new, LIVE) == "b"
    assert table.preferred(old[:2], LIVE) == ""  # dropped
    assert table.preferred(old, LIVE) == "a"  # the last two remain


def test_a_client_key_wins_over_the_text_and_stays_in_its_scope() -> None:
    table = AffinityTable()
    one, other = list(range(100)), list(range(500, 600))
    table.started(table.keys(one, 0, None, None, "user-1"), "a")
    table.finished("a")
    # Other text, same key: a.
    assert table.preferred(table.keys(other, 0, None, None, "user-1"), LIVE) == "a"
    # The same key from another tenant or salt is another key.
    assert table.preferred(table.keys(other, 0, None, "t2", "user-1"), LIVE) == ""
    assert table.preferred(table.keys(other, 0, "s", None, "user-1"), LIVE) == ""
    # Text known on b, key known on a: the key decides.
    table.started(table.keys(other, 0, None, None), "b")
    table.finished("b")
    assert table.preferred(table.keys(other, 0, None, None, "user-1"), LIVE) == "a"
    assert table.preferred(table.keys(other, 0, None, None), LIVE) == "b"


def test_requests_without_affinity_spread_by_the_exact_count_from_their_choice() -> None:
    table = AffinityTable()
    rng = random.Random(0)
    # Six requests arrive together, none answered yet: each sees the ones chosen before it.
    chosen = [table.choose([], LIVE, rng) for _ in range(6)]
    assert sorted(chosen) == ["a", "a", "a", "b", "b", "b"]
    assert table.in_flight("a") == table.in_flight("b") == 3
    for replica in chosen:
        table.started([], replica, replica)  # answered where chosen: counted once
    assert table.in_flight("a") == table.in_flight("b") == 3
    assert table.choose([], set(), rng) == ""  # none live


def test_a_fall_through_moves_the_count_and_the_keys() -> None:
    table = AffinityTable()
    keys = table.keys(list(range(200)), 0, None, None)
    table.started(keys, "a")
    table.finished("a")
    assert table.choose(keys, LIVE) == "a"  # affinity
    table.started(keys, "b", "a")  # Serve found a's queue full and ran it on b
    assert (table.in_flight("a"), table.in_flight("b")) == (0, 1)
    assert table.preferred(keys, LIVE) == "b"
    table.finished("b")
    assert table.choose([], {"a", "b", "c"}, random.Random(1)) in {"a", "b", "c"}
    assert sum(table.in_flight(r) for r in "abc") == 1
