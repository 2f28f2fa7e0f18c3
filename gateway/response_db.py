"""SqliteResponseStore: kept responses in a SQLite file, so that a restart keeps them and
several servers on one host (one file) share them; `open_response_store`: the store
`--response-store` asks for, which never stops a server from starting.

Concurrency: WAL mode (readers never wait for the writer) and a busy timeout; every
operation is one short `BEGIN IMMEDIATE` transaction (every one writes: expired rows go, a
read moves its row up the LRU order), so processes take turns instead of failing. In a
process, the connection is made and used by one thread of the store's own: the routes await
it, and the event loop never waits on the disk.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from gateway.response_store import (
    Clock,
    MemoryResponseStore,
    NewEntry,
    ResponseStore,
    StoredResponse,
    StoreUsage,
)

if TYPE_CHECKING:
    from gateway.config import GatewayConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")

SCHEMA_VERSION = 1  # PRAGMA user_version of a file this code wrote
BUSY_TIMEOUT_S = 5.0  # how long a statement waits for another process's transaction
_SCHEMA = f"""
BEGIN IMMEDIATE;
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT,                   -- the tenant (API key name); NULL without API keys
    stored_at REAL NOT NULL,      -- time.time() when stored: the TTL counts across restarts
    last_used INTEGER NOT NULL,   -- LRU order: larger is more recently used
    num_bytes INTEGER NOT NULL,   -- the two JSON texts' length
    response TEXT NOT NULL,       -- JSON: the response object, as returned
    conversation TEXT NOT NULL    -- JSON: the chat messages of its whole chain
);
-- Totals, the LRU walk (by rowid) and the next last_used read this index alone, never a
-- row's JSON pages.
CREATE INDEX IF NOT EXISTS responses_lru ON responses (last_used, num_bytes);
CREATE INDEX IF NOT EXISTS responses_age ON responses (stored_at);
PRAGMA user_version = {SCHEMA_VERSION};
COMMIT;
"""
_INSERT = """
INSERT INTO responses (id, owner, stored_at, last_used, num_bytes, response, conversation)
VALUES (?, ?, ?, (SELECT COALESCE(MAX(last_used), 0) + 1 FROM responses), ?, ?, ?)
"""
# The JSON read as bytes: text that is not UTF-8 fails in json.loads, as a damaged row, not
# in sqlite3 as a database error.
_SELECT = """
SELECT CAST(response AS BLOB), CAST(conversation AS BLOB), stored_at, num_bytes, owner
FROM responses WHERE id = ?
"""
_TOUCH = "UPDATE responses SET last_used = (SELECT MAX(last_used) + 1 FROM responses) WHERE id = ?"


class NewerDatabaseError(Exception):
    """The file was written by a newer prefixgate (a rolling upgrade sharing it): left as it
    is, and this server keeps its responses in memory."""


class BadDatabaseError(Exception):
    """The file is not a response store this code can read (its check failed, or another
    schema): it is moved aside rather than trusted."""


class SqliteResponseStore(ResponseStore):
    """Entries in the SQLite file `path` (made, with its folder, if missing). A file that
    cannot be read is renamed `<name>.bad-<time>-<pid>` (its -wal and -shm with it: the set
    still opens for a post-mortem, and a stale WAL is never replayed onto a fresh file) and
    a fresh one made, with a warning. Raises (sqlite3.Error, OSError) only when that fails
    too, or when the file is busy: a healthy file another process holds is never moved.

    Opening waits for the file's check (once, as the server starts, before it serves).
    Database errors after that are logged and read as "not kept": a store that cannot be
    read or written costs a client its stored response, never its request."""

    def __init__(
        self,
        path: Path,
        max_entries: int,
        max_bytes: int,
        ttl: float,
        clock: Clock = time.time,
    ) -> None:
        super().__init__(max_entries, max_bytes, ttl, clock)
        self.path = path
        self._db: sqlite3.Connection | None = None
        self._is_closed = False
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="prefixgate-responses")
        try:
            num_entries = self._thread.submit(self._open).result()
        except BaseException:
            self._thread.shutdown()
            raise
        logger.info("stored responses: %s (%d kept)", path, num_entries)

    async def close(self) -> None:
        """Close the connection on its thread (after the work queued before it: the last
        responses are written), then end the thread."""
        if self._is_closed:
            return
        self._is_closed = True
        await self._call(self._close_db)
        self._thread.shutdown()

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, functools.partial(fn, *args))

    # -- on the store's thread ------------------------------------------------------------------
    def _open(self) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = _connect(self.path)
        except (sqlite3.DatabaseError, BadDatabaseError) as exc:
            if _is_busy(exc) or not self.path.is_file():
                raise
            aside = _move_aside(self.path)
            logger.warning(
                "stored responses: %s cannot be read (%s); moved it to %s and started an "
                "empty store",
                self.path,
                exc,
                aside,
            )
            self._db = _connect(self.path)
        count: int = self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]
        return count

    def _close_db(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _insert(self, entry: NewEntry) -> bool:
        def insert(db: sqlite3.Connection) -> bool:
            self._expire(db)
            db.execute("DELETE FROM responses WHERE id = ?", (entry.response_id,))
            row = (entry.response_id, entry.owner, self._clock(), entry.num_bytes)
            db.execute(_INSERT, (*row, entry.response_json, entry.conversation_json))
            self._evict(db)
            return True

        return self._transaction(f"storing {entry.response_id}", insert, False)

    def _get(self, response_id: str) -> StoredResponse | None:
        def get(db: sqlite3.Connection) -> StoredResponse | None:
            self._expire(db)
            row = db.execute(_SELECT, (response_id,)).fetchone()
            if row is None:
                return None
            stored = _decoded(response_id, row)
            if stored is None:  # it will never read: its bytes go
                db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
            else:
                db.execute(_TOUCH, (response_id,))
            return stored

        return self._transaction(f"reading {response_id}", get, None)

    def _delete(self, response_id: str) -> bool:
        def delete(db: sqlite3.Connection) -> bool:
            self._expire(db)
            return db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

        return self._transaction(f"deleting {response_id}", delete, False)

    def _usage(self) -> StoreUsage:
        def usage(db: sqlite3.Connection) -> StoreUsage:
            self._expire(db)
            return StoreUsage(*_totals(db))

        return self._transaction("counting", usage, StoreUsage(0, 0))

    def _transaction(self, what: str, fn: Callable[[sqlite3.Connection], T], failed: T) -> T:
        """`fn` in one `BEGIN IMMEDIATE` transaction (the write lock taken first, so two
        processes' read-modify-writes cannot interleave); `failed` when the database fails
        (logged) or the store is closed."""
        db = self._db
        if db is None:
            logger.error("stored responses: %s after the store was closed", what)
            return failed
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                result = fn(db)
            except BaseException:
                if db.in_transaction:  # some errors end the transaction themselves
                    db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
            return result
        except sqlite3.Error as exc:
            logger.error("stored responses: %s in %s failed: %s", what, self.path, exc)
            return failed

    def _expire(self, db: sqlite3.Connection) -> None:
        db.execute("DELETE FROM responses WHERE stored_at < ?", (self._clock() - self.ttl,))

    def _evict(self, db: sqlite3.Connection) -> None:
        """Least recently used first, until both bounds hold. The entry just stored is the
        most recently used and fits alone, so it stays."""
        num_entries, num_bytes = _totals(db)
        doomed: list[tuple[int]] = []
        lru = db.execute("SELECT rowid, num_bytes FROM responses ORDER BY last_used")
        while num_entries > self.max_entries or num_bytes > self.max_bytes:
            rowid, size = lru.fetchone()
            doomed.append((rowid,))
            num_entries, num_bytes = num_entries - 1, num_bytes - size
        lru.close()
        db.executemany("DELETE FROM responses WHERE rowid = ?", doomed)


def open_response_store(config: GatewayConfig) -> ResponseStore:
    """The store `--response-store` names, bounded by the other `--response-store-*` flags.
    When even a fresh database cannot be used (a folder that cannot be written, a file
    another process holds locked past the busy timeout), the responses are kept in memory
    and an error says why: nothing about the store may stop the server from starting."""
    bounds = (config.response_store_entries, config.response_store_bytes)
    ttl = config.response_store_ttl
    path = config.response_db_path
    if path is None:
        return MemoryResponseStore(*bounds, ttl)
    try:
        return SqliteResponseStore(path, *bounds, ttl)
    except Exception as exc:  # whatever it is, serving goes on
        logger.error(
            "stored responses: cannot use %s (%s: %s); keeping them in memory instead, where "
            "a restart loses them",
            path,
            type(exc).__name__,
            exc,
        )
        return MemoryResponseStore(*bounds, ttl)


def _connect(path: Path) -> sqlite3.Connection:
    """An open, checked store at `path` (created if empty). `quick_check` reads every page,
    so a truncated or damaged file is caught now and not by some later request."""
    # isolation_level=None: no implicit transactions; each operation says BEGIN IMMEDIATE.
    db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    try:
        _use_wal(db)
        # With WAL, NORMAL syncs at checkpoints only: a crashed process loses nothing, a
        # power cut at most the last commits; a cache of responses needs no more.
        db.execute("PRAGMA synchronous = NORMAL")
        check = db.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise BadDatabaseError(f"integrity check: {check}")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:  # a newer server's, live perhaps: never moved aside
            raise NewerDatabaseError(f"schema version {version}, newer than {SCHEMA_VERSION}")
        if version not in (0, SCHEMA_VERSION):
            raise BadDatabaseError(f"schema version {version}, not {SCHEMA_VERSION}")
        db.executescript(_SCHEMA)
    except BaseException:
        db.close()
        raise
    return db


def _use_wal(db: sqlite3.Connection) -> None:
    """Switch a new file to WAL. Two servers that start on a new file together both try,
    and SQLite answers the one that must wait "busy" at once (its busy timeout does not
    apply: the switch upgrades a read lock), so try again until the timeout."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        except sqlite3.OperationalError as exc:
            if not _is_busy(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)
            continue
        if mode != "wal":  # a file system without shared memory: it works, readers wait
            logger.warning("stored responses: journal mode %s, not wal", mode)
        return


def _is_busy(exc: Exception) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and (code & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def _move_aside(path: Path) -> Path:
    aside = path.with_name(f"{path.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    for suffix in ("-wal", "-shm", ""):  # the database last: it is what names the set
        part = path.with_name(path.name + suffix)
        if part.exists():
            part.rename(aside.with_name(aside.name + suffix))
    return aside


def _totals(db: sqlite3.Connection) -> tuple[int, int]:
    num_entries, num_bytes = db.execute(
        "SELECT COUNT(*), COALESCE(SUM(num_bytes), 0) FROM responses"
    ).fetchone()
    return num_entries, num_bytes


def _decoded(response_id: str, row: tuple[Any, ...]) -> StoredResponse | None:
    """The row as an entry; None (with a warning) when its JSON does not decode to a response
    and a conversation: a damaged row reads as absent, never as a server error."""
    response_json, conversation_json, stored_at, num_bytes, owner = row
    try:
        response = json.loads(response_json)
        conversation = json.loads(conversation_json)
    except (TypeError, ValueError) as exc:
        logger.warning("stored responses: %s does not decode (%s); dropped", response_id, exc)
        return None
    if not isinstance(response, dict) or not isinstance(conversation, list):
        logger.warning(
            "stored responses: %s is not a response and a conversation; dropped", response_id
        )
        return None
    return StoredResponse(response, tuple(conversation), stored_at, num_bytes, owner)
