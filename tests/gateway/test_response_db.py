"""gateway.response_db: kept responses in a SQLite file survive a restart (owners, LRU order
and ages with them), several processes share one file without losing a write, a bad file is
moved aside and a bad row reads as absent, the disk work stays off the event loop, and the
configured store always opens (memory when no file can be used)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from gateway import response_db
from gateway.config import GatewayConfig
from gateway.response_db import SqliteResponseStore, open_response_store
from gateway.response_store import MemoryResponseStore, ResponseStore, StoreUsage
from tests.gateway.response_db_writer import write_responses

TTL = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0
        self.thread_names: set[str] = set()  # where the store asked for the time

    def __call__(self) -> float:
        self.thread_names.add(threading.current_thread().name)
        return self.now


def _open(path: Path, clock: Clock, entries: int = 10) -> SqliteResponseStore:
    return SqliteResponseStore(path, entries, 1 << 20, TTL, clock)


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def _kept_after_reopening(path: Path, ids: str) -> dict[str, str | None]:
    store = _open(path, Clock())
    try:
        return _kept(store, ids)
    finally:
        _run(store.close())


def _kept(store: ResponseStore, ids: str) -> dict[str, str | None]:
    """The owner of each id of `ids` that is kept."""
    kept = {}
    for response_id in ids:
        entry = _run(store.get(response_id))
        if entry is not None:
            kept[response_id] = entry.owner
    return kept


def _put(store: ResponseStore, response_id: str, owner: str | None = None) -> None:
    conversation = [{"role": "user", "content": f"about {response_id}"}]
    assert _run(store.put({"id": response_id, "text": response_id}, conversation, owner))


# -- a restart ---------------------------------------------------------------------------------


def test_a_restart_keeps_the_responses_their_owners_and_their_order(tmp_path: Path) -> None:
    clock = Clock()
    store = _open(tmp_path / "r.sqlite3", clock, entries=3)
    _put(store, "a", "alice")
    _put(store, "b")
    _put(store, "c", "carol")
    assert _run(store.get("a")) is not None  # least recently used now: b, c, a
    _run(store.close())

    again = _open(tmp_path / "r.sqlite3", clock, entries=3)
    entry = _run(again.get("c"))  # b, a, c
    assert entry is not None
    assert (entry.response, entry.conversation, entry.owner) == (
        {"id": "c", "text": "c"},
        ({"role": "user", "content": "about c"},),
        "carol",
    )
    _put(again, "d")  # the least recently used goes, as it would have before the restart
    assert _kept(again, "abcd") == {"a": "alice", "c": "carol", "d": None}
    _run(again.close())


def test_the_ttl_counts_across_a_restart(tmp_path: Path) -> None:
    clock = Clock()
    store = _open(tmp_path / "r.sqlite3", clock)
    _put(store, "a")
    clock.now += 30
    _put(store, "b")
    _run(store.close())

    clock.now += TTL - 30 + 1  # a is past its TTL, b is not
    again = _open(tmp_path / "r.sqlite3", clock)
    assert _kept(again, "ab") == {"b": None}
    clock.now += 30
    assert _kept(again, "ab") == {}
    assert _run(again.usage()) == StoreUsage(0, 0)
    _run(again.close())


# -- several processes -------------------------------------------------------------------------


def test_two_processes_writing_at_once_lose_nothing(tmp_path: Path) -> None:
    path, num_responses = tmp_path / "r.sqlite3", 40
    spawn = multiprocessing.get_context("spawn")
    start = spawn.Barrier(2)  # both open the new file together, then write together
    writers = [
        spawn.Process(target=write_responses, args=(str(path), name, num_responses, start))
        for name in ("alice", "bob")
    ]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
    assert [writer.exitcode for writer in writers] == [0, 0]

    store = SqliteResponseStore(path, 2 * num_responses, 1 << 30, 3600.0)
    assert _run(store.usage()).num_entries == 2 * num_responses
    for name in ("alice", "bob"):
        for i in range(num_responses):
            entry = _run(store.get(f"{name}-{i}"))
            assert entry is not None and entry.owner == name
            assert entry.conversation == ({"role": "user", "content": f"turn {i} of {name}"},)
    _run(store.close())


# -- bad files and rows ------------------------------------------------------------------------


def _garbage(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 64)


def _truncated(path: Path) -> None:
    clock = Clock()
    store = _open(path, clock, entries=100)
    for i in range(60):
        assert _run(store.put({"id": f"r{i}", "text": "x" * 2000}, []))
    _run(store.close())  # checkpointed into the file, the WAL gone
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damage", [_garbage, _truncated])
def test_a_bad_file_is_moved_aside_and_a_fresh_one_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Any
) -> None:
    path = tmp_path / "r.sqlite3"
    damage(path)
    bad_bytes = path.read_bytes()
    with caplog.at_level(logging.WARNING, logger="gateway.response_db"):
        store = _open(path, Clock())
    [aside] = tmp_path.glob("r.sqlite3.bad-*")
    assert aside.read_bytes() == bad_bytes  # kept for a post-mortem
    [warning] = [r for r in caplog.records if r.name == "gateway.response_db"]
    assert warning.levelname == "WARNING"
    assert warning.getMessage().startswith(f"stored responses: {path} cannot be read (")
    assert warning.getMessage().endswith(f"moved it to {aside} and started an empty store")
    assert _run(store.usage()) == StoreUsage(0, 0)
    _put(store, "a", "alice")
    _run(store.close())
    assert _kept_after_reopening(path, "a") == {"a": "alice"}


@pytest.mark.parametrize(
    ("bad_json", "why"),
    [
        (
            '{"id": "a", ',
            "does not decode (Expecting property name enclosed in double quotes: line 1 column "
            "13 (char 12))",
        ),
        (
            b"{\xff}",
            "does not decode ('utf-8' codec can't decode byte 0xff in position 1: "
            "invalid start byte)",
        ),
        ("[1, 2]", "is not a response and a conversation"),
        ("null", "is not a response and a conversation"),
    ],
)
def test_a_row_that_does_not_decode_reads_as_absent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, bad_json: str | bytes, why: str
) -> None:
    store = _open(tmp_path / "r.sqlite3", Clock())
    _put(store, "a")
    _put(store, "b")
    with sqlite3.connect(tmp_path / "r.sqlite3") as db:  # another writer damaged one row
        db.execute("UPDATE responses SET response = CAST(? AS TEXT) WHERE id = 'a'", (bad_json,))
    db.close()
    with caplog.at_level(logging.WARNING, logger="gateway.response_db"):
        assert _run(store.get("a")) is None
    assert [r.getMessage() for r in caplog.records if r.name == "gateway.response_db"] == [
        f"stored responses: a {why}; dropped"
    ]
    assert _kept(store, "ab") == {"b": None}
    assert _run(store.usage()).num_entries == 1  # the bad row is gone
    _run(store.close())


# -- off the event loop ------------------------------------------------------------------------


def test_the_database_work_runs_on_the_store_thread(tmp_path: Path) -> None:
    clock = Clock()
    store = _open(tmp_path / "r.sqlite3", clock)
    clock.thread_names.clear()

    async def use() -> None:
        await store.put({"id": "a"}, [])
        assert await store.get("a") is not None
        assert await store.delete("a")

    _run(use())
    assert clock.thread_names == {"prefixgate-responses_0"}
    _run(store.close())


# -- the configured store ----------------------------------------------------------------------


def test_the_configured_store(tmp_path: Path) -> None:
    memory = open_response_store(GatewayConfig(response_store="memory"))
    assert isinstance(memory, MemoryResponseStore)
    path = tmp_path / "deeper" / "r.sqlite3"
    config = GatewayConfig(
        response_store=f"sqlite:{path}",
        response_store_entries=7,
        response_store_bytes=1000,
        response_store_ttl=5.0,
    )
    store = open_response_store(config)
    assert isinstance(store, SqliteResponseStore)
    assert (store.path, store.max_entries, store.max_bytes, store.ttl) == (path, 7, 1000, 5.0)
    assert path.is_file()  # its folder made
    _run(store.close())


def _under_a_file(tmp_path: Path) -> Path:
    (tmp_path / "file").write_text("not a folder")
    return tmp_path / "file" / "r.sqlite3"


def _a_folder(tmp_path: Path) -> Path:
    (tmp_path / "folder").mkdir()
    return tmp_path / "folder"


@pytest.mark.parametrize("where", [_under_a_file, _a_folder])
def test_a_place_no_database_can_use_falls_back_to_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: Any
) -> None:
    path = where(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    with caplog.at_level(logging.ERROR, logger="gateway.response_db"):
        store = open_response_store(GatewayConfig(response_store=f"sqlite:{path}"))
    assert isinstance(store, MemoryResponseStore)
    assert sorted(tmp_path.rglob("*")) == before  # nothing moved aside
    [error] = [r for r in caplog.records if r.name == "gateway.response_db"]
    assert error.getMessage().startswith(f"stored responses: cannot use {path} (")
    assert error.getMessage().endswith(
        "); keeping them in memory instead, where a restart loses them"
    )


def test_a_file_another_process_holds_is_not_moved_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "r.sqlite3"
    store = _open(path, Clock())
    _put(store, "a")
    _run(store.close())
    monkeypatch.setattr(response_db, "BUSY_TIMEOUT_S", 0.1)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # a writer that does not let go
    try:
        with caplog.at_level(logging.ERROR, logger="gateway.response_db"):
            fallback = open_response_store(GatewayConfig(response_store=f"sqlite:{path}"))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert isinstance(fallback, MemoryResponseStore)
    assert "database is locked" in caplog.records[-1].getMessage()
    assert list(tmp_path.glob("*.bad-*")) == []
    assert _kept_after_reopening(path, "a") == {"a": None}


def test_a_newer_servers_file_is_left_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rolling upgrade: a newer prefixgate's file (a later schema) is not this server's to
    move aside; it keeps its responses in memory and says so."""
    path = tmp_path / "r.sqlite3"
    store = _open(path, Clock())
    _put(store, "a")
    _run(store.close())
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version = {response_db.SCHEMA_VERSION + 1}")
    with caplog.at_level(logging.ERROR, logger="gateway.response_db"):
        fallback = open_response_store(GatewayConfig(response_store=f"sqlite:{path}"))
    assert isinstance(fallback, MemoryResponseStore)
    assert "newer than" in caplog.records[-1].getMessage()
    assert list(tmp_path.glob("*.bad-*")) == []
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT id FROM responses").fetchall() == [("a",)]
