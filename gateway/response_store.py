"""Recent responses of the Responses API, kept in memory so that a client can chain a turn
(`previous_response_id`) or fetch a response again (`GET /v1/responses/{id}`).

Bounded three ways, each a flag: entries (least recently used go first), bytes (each entry
counted as its response plus its whole conversation, an upper bound since chained entries
share their history), and age (an entry expires `ttl` seconds after it was stored, used or
not). Nothing survives a restart, and each replica has its own store. Each entry belongs to
the tenant (API key name) that created it: another tenant's id reads as unknown.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as returned
    # The chat messages of the whole chain through this response's output, without its
    # instructions (a chained turn sends its own, as OpenAI does).
    conversation: tuple[dict[str, Any], ...]
    stored_at: float
    num_bytes: int
    owner: str | None = None


class ResponseStore:
    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # least recently used first
        self._by_age: OrderedDict[str, None] = OrderedDict()  # oldest first
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        owner: str | None = None,
    ) -> bool:
        """Keep `response` (under its "id"); False if it alone is over the byte bound."""
        num_bytes = len(json.dumps(response)) + len(json.dumps(conversation))
        if num_bytes > self.max_bytes or self.max_entries == 0:
            logger.warning(
                "response %s not stored: %d bytes (--response-store-bytes %d, entries %d)",
                response["id"],
                num_bytes,
                self.max_bytes,
                self.max_entries,
            )
            return False
        self.delete(response["id"])
        entry = StoredResponse(response, tuple(conversation), self._clock(), num_bytes, owner)
        self._entries[response["id"]] = entry
        self._by_age[response["id"]] = None
        self.num_bytes += num_bytes
        self._evict()
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, or None if it was never stored, was evicted or has expired."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        del self._by_age[response_id]
        self.num_bytes -= entry.num_bytes
        return True

    def _evict(self) -> None:
        self._expire()
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            self.delete(next(iter(self._entries)))

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl
        while self._by_age:
            oldest = next(iter(self._by_age))
            if self._entries[oldest].stored_at >= deadline:
                return
            self.delete(oldest)
