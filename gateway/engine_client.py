"""What the gateway needs of an engine, and of a set of engine replicas.

One process: `engine.AsyncEngine`. Ray Serve (`prefixgate serve --replicas N`): the ingress
holds `replicas.client.ReplicaSet`, which validates like the engine, sends each request to
one replica and reports every replica's state. The routes see only `EngineClient`; /health,
/metrics and the registry listing also read `ReplicaSetView` when the engine has replicas.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from engine import (
    EngineRequest,
    EngineStats,
    GrammarSpec,
    MatchReport,
    PrefixContract,
    ReloadStatus,
    RequestOutput,
    SamplingParams,
)


class EngineClient(Protocol):
    @property
    def model_name(self) -> str: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def is_running(self) -> bool: ...

    async def open(self) -> None:
        """Return once the engine serves (seconds to minutes: the model loads, the registry
        fills); raises what failed."""

    def shutdown(self) -> None: ...

    def prepare_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        tenant: str | None = None,
    ) -> EngineRequest: ...

    def check_grammar(self, spec: GrammarSpec) -> None: ...

    def prefix_contract(
        self, prompt_token_ids: list[int], tenant: str | None = None
    ) -> PrefixContract | None: ...

    def generate(
        self,
        request: EngineRequest,
        request_id: str | None = None,
        affinity_key: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """`affinity_key`: requests with the same key prefer the replica that served the
        last of them (a single engine has nowhere else to run them)."""

    async def reload_prefixes(self) -> ReloadStatus: ...

    async def explain_prefix_match(
        self, token_ids: list[int], cache_salt: str | None = None, tenant: str | None = None
    ) -> MatchReport: ...

    def stats(self) -> EngineStats:
        """A snapshot (replicas: their sum; prefix hits add up by prefix name)."""


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """One engine replica as the ingress last heard from it; `stats` is None when it did not
    answer (`error` says why). `pid`: its worker process. `streaming`: the requests it has
    taken that have not ended, as the ingress counts them now (its stats are as of the last
    poll)."""

    name: str
    stats: EngineStats | None
    error: str | None = None
    pid: int | None = None
    streaming: int = 0


@dataclass(frozen=True, slots=True)
class ReplicaHealth:
    """`problem`: why the set cannot serve as one registry (no replica reports, a reload is
    under way, the replicas hold different registries): /health is 503. `degraded`: what is
    short while it still serves (a replica restarting or not answering): /health is 200 and
    says so, because the others keep taking requests and a load balancer should keep sending
    them."""

    problem: str | None = None
    degraded: str | None = None


@runtime_checkable
class ReplicaSetView(Protocol):
    def replica_states(self) -> list[ReplicaState]: ...

    def health(self) -> ReplicaHealth: ...
