"""Which replica should serve a request: the one that already holds its conversation.

Every replica pins every registered prefix, so a registry hit needs no affinity: those
requests go least-loaded. What a replica holds alone is its automatic prefix cache: the
blocks of the conversations it served (a multi-turn chat resends the earlier turns, a
client repeats a request). The ingress remembers, by content, which replica served which
prompt: the prompt past its registry prefix is cut into `CHUNK_TOKENS`-token chunks, each
named by a chain hash (a chunk's key stands for every token before its end, in the
request's cache scope, as the engine's block hashes do), and each key maps to the replica
that served it last. A new request prefers the replica of its longest known key, unless that
replica holds `slack` more requests than the least loaded one (the load escape); then it
goes least-loaded, and its keys move to wherever it ran. A client's own key
(`prompt_cache_key`, else `user`) is one more key, the strongest: requests that share it go
where the last of them went, whatever their text.

Loads are the ingress's own count of requests in flight per replica: every request passes
through it, so the count is exact without asking the replicas. A request counts from the moment
it is given a replica, not from its first answer: requests that arrive together see each
other and spread, where probed queue lengths (Serve's own router) can be stale for all of them
at once.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

from engine import BlockHash, extend_block_hashes, scope_seed

CHUNK_TOKENS = 32
MAX_KEYS = 200_000  # remembered chunk keys, least recently used dropped (~30 MB at most)


@dataclass
class AffinityTable:
    slack: int = 4
    capacity: int = MAX_KEYS
    _replica_of: OrderedDict[BlockHash, str] = field(default_factory=OrderedDict)
    _in_flight: dict[str, int] = field(default_factory=dict)

    def keys(
        self,
        token_ids: list[int],
        skip_tokens: int,
        cache_salt: str | None,
        tenant: str | None,
        client_key: str | None = None,
    ) -> list[BlockHash]:
        """The chunk keys of `token_ids` that end past the first `skip_tokens` (the registry
        prefix the prompt starts with), shortest first, then `client_key`'s (all in the
        request's cache scope: nobody steers requests next to another tenant's)."""
        hashes: list[BlockHash] = []
        seed = scope_seed("affinity", tenant, cache_salt)
        extend_block_hashes(hashes, token_ids, len(token_ids), CHUNK_TOKENS, seed)
        first = skip_tokens // CHUNK_TOKENS  # chunk i ends at (i + 1) * CHUNK_TOKENS
        keys = hashes[first:]
        if client_key:
            keys.append(scope_seed("affinity-key", tenant, cache_salt, client_key))
        return keys

    def preferred(self, keys: list[BlockHash], live: set[str]) -> str:
        """The replica holding the longest of `keys`, if it is live and not overloaded;
        "" for no preference (least-loaded)."""
        for key in reversed(keys):
            replica = self._replica_of.get(key)
            if replica is None or replica not in live:
                continue
            return replica if self.in_flight(replica) <= self._least(live) + self.slack else ""
        return ""

    def _least(self, live: set[str]) -> int:
        return min((self.in_flight(r) for r in live), default=0)

    def choose(
        self, keys: list[BlockHash], live: set[str], rng: random.Random | None = None
    ) -> str:
        """The replica for a request with `keys`: `preferred`'s, else the least loaded live
        one (ties at random); "" when none is live. It counts in flight from here on."""
        replica = self.preferred(keys, live)
        if not replica and live:
            least = self._least(live)
            replica = (rng or random._inst).choice(
                sorted(r for r in live if self.in_flight(r) == least)
            )
        if replica:
            self._in_flight[replica] = self._in_flight.get(replica, 0) + 1
        return replica

    def started(self, keys: list[BlockHash], replica: str, chosen: str = "") -> None:
        """`replica` took a request with `keys` that `choose` gave to `chosen` (Serve falls
        through to another replica when the chosen one's queue is full; "" for none): count
        it there, and remember the keys there."""
        if replica != chosen:
            if chosen:
                self.finished(chosen)
            self._in_flight[replica] = self._in_flight.get(replica, 0) + 1
        for key in keys:
            self._replica_of[key] = replica
            self._replica_of.move_to_end(key)
        while len(self._replica_of) > self.capacity:
            self._replica_of.popitem(last=False)

    def finished(self, replica: str) -> None:
        left = self._in_flight.get(replica, 0) - 1
        if left > 0:
            self._in_flight[replica] = left
        else:
            self._in_flight.pop(replica, None)

    def in_flight(self, replica: str) -> int:
        return self._in_flight.get(replica, 0)
