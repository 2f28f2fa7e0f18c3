"""Kept responses of the Responses API, so that a client can chain a turn
(`previous_response_id`) or fetch a response again (`GET /v1/responses/{id}`).

`ResponseStore` is what the routes await. Two kinds hold the entries: `MemoryResponseStore`
(this process only: a restart loses them) and `SqliteResponseStore` (response_db.py: a file
that survives restarts and that several servers on one host can share). Both are bounded
the same three ways, each a flag: entries (least recently used go first), bytes (each entry
counted as its response plus its whole conversation, an upper bound since chained entries
share their history), and age (an entry expires `ttl` seconds after it was stored, used or
not). Ages are wall-clock time (`time.time()`), the one clock whose readings still mean
something to the next process. Each entry belongs to the tenant (API key name) that created
it; the routes show another tenant's entry as unknown.
"""

from __future__ import annotations

import json
import logging
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")
Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as returned
    # The chat messages of the whole chain through this response's output, without its
    # instructions (a chained turn sends its own, as OpenAI does).
    conversation: tuple[dict[str, Any], ...]
    stored_at: float  # time.time() when it was stored
    num_bytes: int
    owner: str | None = None


@dataclass(frozen=True, slots=True)
class StoreUsage:
    num_entries: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
class NewEntry:
    """A response about to be kept, with its JSON: the JSON's length is the entry's size in
    both stores (ASCII-only JSON, so characters are bytes), and is what SQLite writes."""

    response_id: str
    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    owner: str | None
    response_json: str
    conversation_json: str

    @classmethod
    def of(
        cls, response: dict[str, Any], conversation: list[dict[str, Any]], owner: str | None
    ) -> NewEntry:
        return cls(
            response["id"],
            response,
            conversation,
            owner,
            json.dumps(response),
            json.dumps(conversation),
        )

    @property
    def num_bytes(self) -> int:
        return len(self.response_json) + len(self.conversation_json)


class ResponseStore(ABC):
    """The kept responses, behind awaitables so that no store can hold up the event loop.

    A subclass keeps the entries with four synchronous primitives (`_insert`, `_get`,
    `_delete`, `_usage`) and says where they run (`_call`): the memory store runs them
    inline (dictionary work), the SQLite store on its own thread. `clock` gives the time
    (`time.time()`; tests pass their own)."""

    def __init__(self, max_entries: int, max_bytes: int, ttl: float, clock: Clock = time.time):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._clock = clock

    async def put(
        self,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        owner: str | None = None,
    ) -> bool:
        """Keep `response` (under its "id") with its conversation, replacing an entry of
        that id. False if it was not kept: alone over the byte bound, no entries allowed,
        or the store failed (logged)."""
        return await self._call(self._put, response, conversation, owner)

    async def get(self, response_id: str) -> StoredResponse | None:
        """The entry, now the most recently used; None if it was never stored, was evicted,
        has expired or cannot be read (logged)."""
        return await self._call(self._get, response_id)

    async def delete(self, response_id: str) -> bool:
        return await self._call(self._delete, response_id)

    async def usage(self) -> StoreUsage:
        """The entries kept now (the expired ones dropped first) and their bytes."""
        return await self._call(self._usage)

    @abstractmethod
    async def close(self) -> None:
        """Release what the store holds open (app shutdown)."""

    def _put(
        self, response: dict[str, Any], conversation: list[dict[str, Any]], owner: str | None
    ) -> bool:
        entry = NewEntry.of(response, conversation, owner)
        if entry.num_bytes > self.max_bytes or self.max_entries == 0:
            logger.warning(
                "response %s not stored: %d bytes (--response-store-bytes %d, entries %d)",
                entry.response_id,
                entry.num_bytes,
                self.max_bytes,
                self.max_entries,
            )
            return False
        return self._insert(entry)

    @abstractmethod
    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, run where this store does its work."""

    @abstractmethod
    def _insert(self, entry: NewEntry) -> bool:
        """Keep an entry that fits alone, evicting as the bounds say; False if it failed."""

    @abstractmethod
    def _get(self, response_id: str) -> StoredResponse | None: ...

    @abstractmethod
    def _delete(self, response_id: str) -> bool: ...

    @abstractmethod
    def _usage(self) -> StoreUsage: ...


class MemoryResponseStore(ResponseStore):
    """Entries in this process's memory: an LRU (an ordered dict) beside an age queue."""

    def __init__(self, max_entries: int, max_bytes: int, ttl: float, clock: Clock = time.time):
        super().__init__(max_entries, max_bytes, ttl, clock)
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self._by_age: OrderedDict[str, None] = OrderedDict()  # oldest first
        self._num_bytes = 0

    async def close(self) -> None:
        """Nothing to release: the entries end with the process."""

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)

    def _insert(self, entry: NewEntry) -> bool:
        self._delete(entry.response_id)
        stored = StoredResponse(
            entry.response,
            tuple(entry.conversation),
            self._clock(),
            entry.num_bytes,
            entry.owner,
        )
        self._entries[entry.response_id] = stored
        self._by_age[entry.response_id] = None
        self._num_bytes += entry.num_bytes
        self._evict()
        return True

    def _get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def _delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        del self._by_age[response_id]
        self._num_bytes -= entry.num_bytes
        return True

    def _usage(self) -> StoreUsage:
        self._expire()
        return StoreUsage(len(self._entries), self._num_bytes)

    def _evict(self) -> None:
        self._expire()
        while len(self._entries) > self.max_entries or self._num_bytes > self.max_bytes:
            self._delete(next(iter(self._entries)))

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl
        while self._by_age:
            oldest = next(iter(self._by_age))
            if self._entries[oldest].stored_at >= deadline:
                return
            self._delete(oldest)
