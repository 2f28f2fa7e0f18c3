"""gateway.response_store: the bounds on kept responses (entries, bytes, age) and their
owners, the same in both stores: memory and SQLite (response_db.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.response_db import SqliteResponseStore
from gateway.response_store import MemoryResponseStore, ResponseStore, StoredResponse, StoreUsage


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Kept:
    """A store driven from a test: each awaitable run to its end."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        return asyncio.run(self.store.put(response, conversation))

    def get(self, response_id: str) -> StoredResponse | None:
        return asyncio.run(self.store.get(response_id))

    def delete(self, response_id: str) -> bool:
        return asyncio.run(self.store.delete(response_id))

    @property
    def usage(self) -> StoreUsage:
        return asyncio.run(self.store.usage())


def _response(response_id: str, text: str = "") -> dict[str, Any]:
    return {"id": response_id, "output_text": text}


@pytest.fixture(params=["memory", "sqlite"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def clock() -> Clock:
    return Clock()


Make = Callable[..., Kept]


@pytest.fixture
def make(kind: str, tmp_path: Path, clock: Clock) -> Iterator[Make]:
    """Opens a store of `kind` with the given bounds on `clock`; closes it after the test."""
    opened: list[ResponseStore] = []

    def make(entries: int = 10, num_bytes: int = 1 << 20, ttl: float = 60.0) -> Kept:
        store: ResponseStore
        if kind == "memory":
            store = MemoryResponseStore(entries, num_bytes, ttl, clock)
        else:
            store = SqliteResponseStore(tmp_path / "r.sqlite3", entries, num_bytes, ttl, clock)
        opened.append(store)
        return Kept(store)

    yield make
    for store in opened:
        asyncio.run(store.close())


def test_keeps_the_response_its_conversation_and_owner(make: Make, clock: Clock) -> None:
    kept = make()
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert asyncio.run(kept.store.put(_response("a"), conversation, "alice"))
    assert asyncio.run(kept.store.put(_response("b"), []))
    # Its size: the two JSON texts, '{"id": "a", "output_text": ""}' and the conversation's.
    num_bytes = 30 + 75
    assert kept.get("a") == StoredResponse(
        _response("a"), tuple(conversation), clock.now, num_bytes, "alice"
    )
    entry = kept.get("b")
    assert entry is not None and entry.owner is None
    assert kept.get("c") is None


def test_least_recently_used_goes_first(make: Make) -> None:
    kept = make(entries=2)
    kept.put(_response("a"), [])
    kept.put(_response("b"), [])
    assert kept.get("a") is not None  # a is now the most recently used
    kept.put(_response("c"), [])
    assert [r for r in "abc" if kept.get(r) is not None] == ["a", "c"]
    assert kept.usage.num_entries == 2


def test_the_byte_bound_evicts_and_refuses_what_can_never_fit(make: Make) -> None:
    kept = make(num_bytes=300)
    kept.put(_response("a", "x" * 100), [])
    kept.put(_response("b", "x" * 100), [])
    assert kept.usage.num_bytes <= 300 and kept.usage.num_entries == 2
    assert kept.get("a") is not None  # b is now the least recently used
    kept.put(_response("c", "x" * 100), [])
    assert [r for r in "abc" if kept.get(r) is not None] == ["a", "c"]
    assert kept.usage.num_bytes <= 300
    assert not kept.put(_response("huge", "x" * 400), [])
    assert kept.get("huge") is None and kept.get("c") is not None


def test_entries_expire_after_the_ttl_used_or_not(make: Make, clock: Clock) -> None:
    kept = make(ttl=60.0)
    kept.put(_response("old"), [])
    clock.now += 30
    kept.put(_response("new"), [])
    assert kept.get("old") is not None  # using it does not extend its life
    clock.now += 31
    assert kept.get("old") is None and kept.get("new") is not None
    clock.now += 30
    assert kept.get("new") is None
    assert kept.usage == StoreUsage(0, 0)


def test_delete_and_replace_keep_the_byte_count_true(make: Make) -> None:
    kept = make()
    kept.put(_response("a", "x" * 50), [])
    size = kept.usage.num_bytes
    kept.put(_response("a", "x" * 50), [])
    assert kept.usage == StoreUsage(1, size)
    assert kept.delete("a") and not kept.delete("a")
    assert kept.usage == StoreUsage(0, 0)


def test_zero_entries_keeps_nothing(make: Make) -> None:
    kept = make(entries=0)
    assert not kept.put(_response("a"), [])
    assert kept.get("a") is None
