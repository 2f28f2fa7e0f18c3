"""ReplicaSet: the gateway's engine when the engines are Ray Serve replicas.

It does at the ingress what the single-process gateway asks of its AsyncEngine: validate with
the engine's own `RequestChecker` (the model's facts come from a replica at start), answer
prefix contracts from the entries the replicas accepted, and stream each request from one
replica. A task on the ingress's event loop polls every replica's report (`poll_interval`):
stats for /metrics and the registry listing, the registry digests /health compares, the
prefix entries for contracts and affinity. Everything here awaits Serve's handle on the
ingress's own loop (no blocking `.result()`), so Serve may run its router on that loop.

Faults: a replica that dies (or whose engine stopped) fails the requests streaming from it
with EngineUnavailableError (503, retry); a request no replica takes within `request_timeout`
(all of them down or restarting) gets the same instead of waiting forever. A replica that
does not answer a poll is reported as such while the others' reports still count.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Coroutine
from dataclasses import replace
from typing import Any, TypeVar

from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import RayServeException
from ray.serve.handle import (
    DeploymentBroadcastResponse,
    DeploymentHandle,
    DeploymentResponseGenerator,
)

from engine import (
    EngineDeadError,
    EngineRequest,
    EngineStats,
    EngineUnavailableError,
    GrammarSpec,
    MatchReport,
    PrefixContract,
    PrefixIndex,
    PrefixSpec,
    ReloadStatus,
    RequestChecker,
    RequestLimits,
    RequestOutput,
    SamplingParams,
)
from gateway.engine_client import ReplicaHealth, ReplicaState
from replicas.affinity import AffinityTable
from replicas.replica import ModelFacts, ReplicaReport
from replicas.stats import sum_stats

logger = logging.getLogger(__name__)
T = TypeVar("T")
# Between two tries of `open`, while no replica answers (they may take minutes to load).
_OPEN_BACKOFF_SECONDS = (1.0, 2.0, 5.0, 10.0)
# How often the ingress polls while a replica is missing, for how long at most (one that
# cannot be placed or keeps failing to load is then looked for at the usual interval); see
# `ReplicaSet._poll_loop`.
DEGRADED_POLL_INTERVAL = 0.1
DEGRADED_POLL_WINDOW = 60.0


def replica_fault(exc: BaseException) -> str | None:
    """What went wrong when `exc` says a replica cannot serve (it died, is unreachable, Serve
    has none to offer, or its engine stopped) and the request may succeed elsewhere; None
    for the replica's own answer (a RayTaskError wrapping, say, an InvalidRequestError is a
    400 and stays one)."""
    if isinstance(exc, EngineDeadError):  # also a RayTaskError: Ray keeps the cause's type
        return "its engine stopped"
    if isinstance(exc, RayTaskError):
        return None
    if isinstance(exc, RayError | RayServeException):
        return type(exc).__name__
    return None


class ReplicaSet:
    def __init__(
        self,
        handle: DeploymentHandle[Any],
        num_replicas: int,
        request_timeout: float = 60.0,
        poll_interval: float = 0.5,
        affinity_slack: int = 4,
    ) -> None:
        self._handle = handle
        self.num_replicas = num_replicas
        self.request_timeout = request_timeout
        self.poll_interval = poll_interval
        self.affinity = AffinityTable(slack=affinity_slack)
        self._facts: ModelFacts | None = None
        self._checker: RequestChecker | None = None
        self._reports: dict[str, ReplicaReport] = {}
        self._poll_errors: list[str] = []
        self._last_poll = 0.0
        self._specs_digest: str | None = None
        self._spec_index: PrefixIndex[PrefixSpec] | None = None
        self._is_stopped = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._poll_requested = asyncio.Event()
        self._polls_begun = 0  # numbers the polls, so a caller can wait for a later one
        self._newest_poll_ended = 0
        self._poll_ended = asyncio.Condition()
        self._streaming: Counter[str] = Counter()  # by replica: requests taken, not ended

    # -- lifecycle --------------------------------------------------------------------------------
    async def open(self) -> None:
        """Learn the model from a replica and hear from all of them once. Replicas may take
        minutes to load the model and fill the registry, and Serve restarts one that fails:
        ask again until one answers (each try bounded by `request_timeout`), so the ingress
        never stays unconnected while the replicas come up."""
        for attempt in itertools.count():
            try:
                facts: ModelFacts = await self._call(self._handle.facts.remote())
                break
            except EngineUnavailableError as exc:
                backoff = _OPEN_BACKOFF_SECONDS[min(attempt, len(_OPEN_BACKOFF_SECONDS) - 1)]
                logger.warning("ingress: waiting for the engine replicas: %s", exc)
                await asyncio.sleep(backoff)
        self._facts = facts
        self._checker = RequestChecker(facts.tokenizer, facts.eos_token_ids, self._limits)
        await self._poll()
        self._spawn(self._poll_loop())
        logger.info(
            "ingress: %s on %d replicas (%s)",
            facts.model_name,
            self.num_replicas,
            ", ".join(sorted(self._reports)) or "none reported yet",
        )

    def shutdown(self) -> None:
        self._is_stopped = True
        for task in list(self._tasks):
            task.cancel()

    @property
    def is_running(self) -> bool:
        return self._facts is not None and not self._is_stopped

    # -- facts --------------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self._ready_facts().model_name

    @property
    def tokenizer(self) -> Any:
        return self._ready_facts().tokenizer

    @property
    def max_model_len(self) -> int:
        return self._ready_facts().limits.max_model_len

    def _ready_facts(self) -> ModelFacts:
        if self._facts is None:
            raise EngineUnavailableError("the engine replicas are not connected yet")
        return self._facts

    def _limits(self) -> RequestLimits:
        """The facts' limits with the fewest usable KV blocks any replica reports."""
        limits = self._ready_facts().limits
        usable = [r.limits.num_usable_blocks for r in list(self._reports.values())]
        return replace(limits, num_usable_blocks=min(usable)) if usable else limits

    # -- validation, as the engine does it ----------------------------------------------------
    def prepare_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        tenant: str | None = None,
    ) -> EngineRequest:
        return self._ready_checker().prepare(prompt_token_ids, params, cache_salt, tenant)

    def check_grammar(self, spec: GrammarSpec) -> None:
        self._ready_checker().compile(spec)

    def _ready_checker(self) -> RequestChecker:
        if self._checker is None:
            raise EngineUnavailableError("the engine replicas are not connected yet")
        return self._checker

    def prefix_contract(
        self, prompt_token_ids: list[int], tenant: str | None = None
    ) -> PrefixContract | None:
        spec = self._registry_entry(prompt_token_ids, tenant)
        return spec.contract if spec is not None else None

    def _registry_entry(self, token_ids: list[int], tenant: str | None) -> PrefixSpec | None:
        index = self._spec_index
        if index is None:
            return None
        return index.longest(token_ids, visible=lambda s: s.visible_to(tenant))

    # -- requests -------------------------------------------------------------------------------
    async def generate(
        self,
        request: EngineRequest,
        request_id: str | None = None,
        affinity_key: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream `request` from one replica: the one holding its conversation (or the last
        request with its `affinity_key`) if it is not overloaded, else the least loaded
        (`AffinityTable.choose`); Serve's router falls through to others if its queue is full."""
        ids = request.prompt_token_ids
        entry = self._registry_entry(ids, request.tenant)
        keys = self.affinity.keys(
            ids,
            len(entry.token_ids) if entry else 0,
            request.cache_salt,
            request.tenant,
            affinity_key,
        )
        chosen = self.affinity.choose(keys, set(self._reports))
        stream: DeploymentResponseGenerator[Any] | None = None
        replica: str | None = None
        finished = False
        try:  # from here on the chosen replica's count is given back whatever happens
            stream = self._handle.options(  # type: ignore[assignment]
                stream=True, session_id=chosen
            ).generate.remote(
                ids,
                request.params,
                request.cache_salt,
                request.tenant,
                request_id or uuid.uuid4().hex,
            )
            assert stream is not None
            try:
                name: str = await asyncio.wait_for(stream.__anext__(), self.request_timeout)
            except TimeoutError:
                raise EngineUnavailableError(
                    f"no engine replica took the request within {self.request_timeout:g} s"
                ) from None
            replica = name
            self._streaming[name] += 1
            self.affinity.started(keys, name, chosen)
            async for output in stream:
                finished = output.finished
                yield output
        except Exception as exc:
            if (fault := replica_fault(exc)) is None:
                raise
            if replica is None:  # Serve found no replica, or the chosen one was gone already
                message = f"no engine replica could take this request ({fault})"
            else:
                message = f"replica {replica} failed while serving this request ({fault})"
            raise EngineUnavailableError(
                f"{message}; the other replicas keep serving: retry"
            ) from None
        finally:
            if replica is not None:
                self._streaming[replica] -= 1
                if not self._streaming[replica]:
                    del self._streaming[replica]
            if replica is not None or chosen:
                self.affinity.finished(replica if replica is not None else chosen)
            if stream is not None and not finished:
                stream.cancel()  # type: ignore[no-untyped-call]

    async def reload_prefixes(self) -> ReloadStatus:
        """Reload on every replica; failed if any replica failed or did not answer."""
        results = await self._handle.broadcast("reload").results_async(return_exceptions=True)
        errors, statuses = [], []
        for result in results:
            if isinstance(result, BaseException):
                errors.append(f"a replica did not answer: {result!r}")
                continue
            name, status = result
            statuses.append(status)
            if not status.ok:
                errors.append(f"replica {name}: {status.error}")
        if len(statuses) < self.num_replicas and not errors:
            errors.append(f"only {len(statuses)} of {self.num_replicas} replicas reloaded")
        await self._fresh_poll()
        return ReloadStatus(
            time=max((s.time or 0.0 for s in statuses), default=time.time()),
            ok=not errors,
            error="; ".join(errors) or None,
            num_prefixes=max((s.num_prefixes for s in statuses), default=0),
        )

    async def explain_prefix_match(
        self, token_ids: list[int], cache_salt: str | None = None, tenant: str | None = None
    ) -> MatchReport:
        """Asked of one replica: they all hold the same registry once /health is 200."""
        return await self._call(self._handle.explain.remote(token_ids, cache_salt, tenant))

    async def _call(self, response: Awaitable[T]) -> T:
        """One replica's answer within `request_timeout`; faults and silence are 503s."""
        fault: str | None
        try:
            return await asyncio.wait_for(response, self.request_timeout)
        except TimeoutError:
            fault = f"no answer within {self.request_timeout:g} s"
        except Exception as exc:
            if (fault := replica_fault(exc)) is None:
                raise
        raise EngineUnavailableError(f"no engine replica could answer ({fault}): retry")

    # -- state of the replicas ----------------------------------------------------------------
    def stats(self) -> EngineStats:
        reports = list(self._reports.values())
        if not reports:
            raise EngineUnavailableError("no engine replica has reported yet")
        return sum_stats([r.stats for r in reports])

    def replica_states(self) -> list[ReplicaState]:
        states = [
            ReplicaState(name, r.stats, pid=r.pid, streaming=self._streaming[name])
            for name, r in sorted(self._reports.items())
        ]
        states += [ReplicaState("?", None, error) for error in self._poll_errors]
        return states

    def health(self) -> ReplicaHealth:
        if self._facts is None:
            return ReplicaHealth("connecting to the engine replicas")
        if time.monotonic() - self._last_poll > max(10 * self.poll_interval, 5.0):
            return ReplicaHealth("the engine replicas have not reported for a while")
        reports = dict(self._reports)
        if not reports:
            return ReplicaHealth("no engine replica answers")
        loading = sorted(name for name, r in reports.items() if r.stats.is_reload_pending)
        if loading:
            return ReplicaHealth(f"replicas loading prefixes: {', '.join(loading)}")
        digests = {r.stats.registry_digest for r in reports.values()}
        if len(digests) > 1:
            held = ", ".join(f"{n}={r.stats.registry_digest}" for n, r in sorted(reports.items()))
            return ReplicaHealth(f"the replicas hold different registries ({held})")
        if len(reports) < self.num_replicas:
            return ReplicaHealth(
                degraded=f"{len(reports)} of {self.num_replicas} engine replicas serve"
            )
        return ReplicaHealth()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _poll_loop(self) -> None:
        """One poll at a time: every `poll_interval`, or sooner when `_fresh_poll` asks, and
        every `DEGRADED_POLL_INTERVAL` for up to `DEGRADED_POLL_WINDOW` seconds after fewer
        replicas report than should: requests go to the replicas the last poll heard from,
        so a replacement takes requests from the first poll after it is up (up to half a
        second later, at the usual interval)."""
        missing_since: float | None = None
        while True:
            interval = self.poll_interval
            if len(self._reports) >= self.num_replicas:
                missing_since = None
            else:
                missing_since = missing_since or time.monotonic()
                if time.monotonic() - missing_since < DEGRADED_POLL_WINDOW:
                    interval = min(interval, DEGRADED_POLL_INTERVAL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poll_requested.wait(), interval)
            self._poll_requested.clear()
            try:
                await self._poll()
            except Exception:  # keep polling: /health reports the silence
                logger.exception("polling the engine replicas failed")

    async def _fresh_poll(self) -> None:
        """Wait for a poll begun after this call, so what an operator reads right after a
        reload (the listing, /health, /metrics) shows its outcome, not the replicas' state
        before it. Bounded: a stopped poll loop or silent replicas do not hold the answer."""
        wanted = self._polls_begun + 1
        self._poll_requested.set()
        async with self._poll_ended:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._poll_ended.wait_for(lambda: self._newest_poll_ended >= wanted),
                    2 * self._poll_timeout,
                )

    @property
    def _poll_timeout(self) -> float:
        return max(self.poll_interval * 4, 2.0)

    async def _poll(self) -> None:
        """Every replica's report; one that does not answer within the poll's timeout is
        listed with that error and the others still count. A replica sends its prefix
        entries only when they are not the ones this ingress holds (`specs_digest`)."""
        self._polls_begun += 1
        number = self._polls_begun
        try:
            await self._take_reports()
        finally:
            async with self._poll_ended:
                self._newest_poll_ended = max(self._newest_poll_ended, number)
                self._poll_ended.notify_all()

    async def _take_reports(self) -> None:
        answers = await each_replica(
            self._handle.broadcast("report", self._specs_digest), self._poll_timeout
        )
        reports = {r.name: r for r in answers if isinstance(r, ReplicaReport)}
        self._poll_errors = [repr(r) for r in answers if isinstance(r, BaseException)]
        self._adopt_specs(list(reports.values()))
        self._log_changes(set(self._reports), set(reports))
        self._reports = reports
        self._last_poll = time.monotonic()

    def _log_changes(self, before: set[str], now: set[str]) -> None:
        """A line for each replica that stopped or started reporting: requests go only to
        the replicas the last poll heard from, and /health is "degraded" while too few do."""
        serving = f"{len(now)} of {self.num_replicas} engine replicas serve"
        for name in sorted(before - now):
            logger.warning("ingress: replica %s stopped reporting; %s", name, serving)
        for name in sorted(now - before):
            logger.info("ingress: replica %s reports; %s", name, serving)

    def _adopt_specs(self, reports: list[ReplicaReport]) -> None:
        """Answer contracts and affinity from the entries most replicas hold (ties: the one
        held already, else the smallest digest), so the index does not flip with the order
        the reports came in while replicas disagree (a reload under way)."""
        held = Counter(r.specs_digest for r in reports)
        if not held:
            return
        most = max(held.values())
        candidates = sorted(digest for digest, n in held.items() if n == most)
        digest = self._specs_digest if self._specs_digest in candidates else candidates[0]
        if digest == self._specs_digest:
            return
        source = next(r for r in reports if r.specs_digest == digest and r.specs is not None)
        self._spec_index = PrefixIndex(
            source.specs or (), lambda s: s.token_ids, source.limits.block_size
        )
        self._specs_digest = digest


async def each_replica(response: DeploymentBroadcastResponse, timeout: float) -> list[Any]:
    """Each replica's answer to a broadcast, or its exception; a replica silent for
    `timeout` seconds gives a TimeoutError while the others' answers count (Serve's own
    `results_async(timeout_s=...)` times the broadcast out as a whole). Uses the response's
    replica results, which Serve 2.60 keeps behind `_fetch_replica_results_async`."""
    results = await asyncio.wait_for(response._fetch_replica_results_async(), timeout)

    async def answer(result: Any) -> Any:
        try:
            return await asyncio.wait_for(result.get_async(), timeout)
        except TimeoutError:
            return TimeoutError(f"a replica did not answer within {timeout:g} s")

    return list(await asyncio.gather(*map(answer, results), return_exceptions=True))
