"""gateway.response_store: the bounds on kept responses (entries, bytes, age)."""

from __future__ import annotations

from typing import Any

from gateway.response_store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _response(response_id: str, text: str = "") -> dict[str, Any]:
    return {"id": response_id, "output_text": text}


def _store(entries: int = 10, num_bytes: int = 1 << 20, ttl: float = 60.0) -> ResponseStore:
    return ResponseStore(entries, num_bytes, ttl, clock=CLOCK)


CLOCK = Clock()


def test_keeps_the_response_and_its_conversation() -> None:
    store = _store()
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert store.put(_response("a"), conversation)
    entry = store.get("a")
    assert entry is not None
    assert entry.response == _response("a") and list(entry.conversation) == conversation
    assert store.get("b") is None


def test_least_recently_used_goes_first() -> None:
    store = _store(entries=2)
    store.put(_response("a"), [])
    store.put(_response("b"), [])
    assert store.get("a") is not None  # a is now the most recently used
    store.put(_response("c"), [])
    assert [r for r in "abc" if store.get(r) is not None] == ["a", "c"]
    assert len(store) == 2


def test_the_byte_bound_evicts_and_refuses_what_can_never_fit() -> None:
    store = _store(num_bytes=300)
    store.put(_response("a", "x" * 100), [])
    store.put(_response("b", "x" * 100), [])
    assert store.num_bytes <= 300 and len(store) == 2
    store.put(_response("c", "x" * 100), [])
    assert store.get("a") is None and store.get("c") is not None
    assert store.num_bytes <= 300
    assert not store.put(_response("huge", "x" * 400), [])
    assert store.get("huge") is None and store.get("c") is not None


def test_entries_expire_after_the_ttl_used_or_not() -> None:
    CLOCK.now = 1000.0
    store = _store(ttl=60.0)
    store.put(_response("old"), [])
    CLOCK.now += 30
    store.put(_response("new"), [])
    assert store.get("old") is not None  # using it does not extend its life
    CLOCK.now += 31
    assert store.get("old") is None and store.get("new") is not None
    CLOCK.now += 30
    assert store.get("new") is None
    assert len(store) == 0 and store.num_bytes == 0


def test_delete_and_replace_keep_the_byte_count_true() -> None:
    store = _store()
    store.put(_response("a", "x" * 50), [])
    size = store.num_bytes
    store.put(_response("a", "x" * 50), [])
    assert store.num_bytes == size and len(store) == 1
    assert store.delete("a") and not store.delete("a")
    assert store.num_bytes == 0


def test_zero_entries_keeps_nothing() -> None:
    store = _store(entries=0)
    assert not store.put(_response("a"), [])
    assert store.get("a") is None
