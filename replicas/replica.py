"""EngineReplica: the engine deployment's class, one AsyncEngine per Ray Serve replica.

The constructor loads the model and pre-fills and pins every prefix of the prefixes file
before it returns, and Serve sends a replica no traffic before its constructor returned: a
replica that Serve restarts after a fault holds the registry before it takes a request. It
reads the prefixes file as it is now, so it comes back with the registry the others reloaded.

Each replica watches the prefixes file itself (the engine's poll), as the single-process
server does; `POST /v1/prefixes/reload` reaches all of them through `reload`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine import (
    AsyncEngine,
    EngineConfig,
    EngineStats,
    MatchReport,
    PrefixSpec,
    ReloadStatus,
    RequestLimits,
    RequestOutput,
    SamplingParams,
    registry_digest,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the ingress needs to tokenize and validate as the replicas would."""

    model_name: str
    tokenizer: Any
    eos_token_ids: frozenset[int]
    limits: RequestLimits


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """One replica's state for the ingress: its engine stats and the prefix entries it
    accepted (`specs_digest` names them; `specs` is None when the ingress said it holds
    those already, which is every poll but the ones after a reload). `pid`: its worker
    process, so an operator can tell which process is which replica."""

    name: str
    stats: EngineStats
    limits: RequestLimits
    specs_digest: str
    specs: tuple[PrefixSpec, ...] | None
    pid: int


class EngineReplica:
    """`stream_interval`: completion tokens a stream gathers before it sends them to the
    ingress (its first output and its last go at once): every message wakes the ingress and
    Serve's proxy, which on a small machine take their CPU from the engine's threads."""

    def __init__(self, config: EngineConfig, stream_interval: int = 1) -> None:
        from ray import serve

        if not logging.getLogger().handlers:  # a Ray worker: the engine's lines to its stderr
            logging.basicConfig(
                level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
            )
        self.name = serve.get_replica_context().replica_id.unique_id
        self.stream_interval = stream_interval
        self.engine = AsyncEngine(config)
        self.engine.start()  # model load and registry prefill, before Serve routes here
        self._specs_source: object = None
        self._specs: tuple[PrefixSpec, ...] = ()
        self._specs_digest = registry_digest(())
        logger.info("replica %s serves %s", self.name, self.engine.model_name)

    def facts(self) -> ModelFacts:
        engine = self.engine.engine
        return ModelFacts(engine.model_name, engine.tokenizer, engine.eos_token_ids, engine.limits)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
        tenant: str | None,
        request_id: str,
    ) -> AsyncIterator[str | RequestOutput]:
        """This replica's name first (the ingress counts and remembers where requests run),
        then the request's outputs. The request is checked again here, against this pool."""
        yield self.name
        if params.grammar is None:
            request = self.engine.prepare_request(prompt_token_ids, params, cache_salt, tenant)
        else:  # compiling may take a while: not on this replica's event loop
            request = await asyncio.to_thread(
                self.engine.prepare_request, prompt_token_ids, params, cache_salt, tenant
            )
        gathered: RequestOutput | None = None
        is_first = True
        try:
            async for output in self.engine.generate(request, request_id):
                gathered = output if gathered is None else gathered.followed_by(output)
                if is_first or gathered.finished or len(gathered.token_ids) >= self.stream_interval:
                    yield gathered
                    gathered, is_first = None, False
        except Exception:
            if gathered is not None:  # the tokens made before the failure still reach the client
                yield gathered
            raise

    def report(self, known_specs_digest: str | None = None) -> ReplicaReport:
        """`known_specs_digest`: the entries the ingress holds; sent again only if ours differ."""
        engine = self.engine.engine
        specs = engine.prefixes.specs  # replaced, never mutated, on each accepted load
        if specs is not self._specs_source:
            self._specs_source, self._specs = specs, tuple(specs)
            self._specs_digest = registry_digest(self._specs)
        sent = None if self._specs_digest == known_specs_digest else self._specs
        return ReplicaReport(
            self.name, self.engine.stats(), engine.limits, self._specs_digest, sent, os.getpid()
        )

    async def reload(self) -> tuple[str, ReloadStatus]:
        return self.name, await self.engine.reload_prefixes()

    async def explain(
        self, token_ids: list[int], cache_salt: str | None, tenant: str | None
    ) -> MatchReport:
        return await self.engine.explain_prefix_match(token_ids, cache_salt, tenant)

    def check_health(self) -> None:
        """Serve's periodic health check: a replica whose engine loop died is restarted."""
        if not self.engine.is_running:
            raise RuntimeError(f"replica {self.name}: the engine loop has stopped")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
