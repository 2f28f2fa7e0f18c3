"""ReplicaSet at the ingress, over a stand-in for Serve's handle: health from the replicas'
reports, validation against the tightest replica, contracts from the replicas' entries."""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, ObjectLostError, RayTaskError
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from engine import PrefixContract, PrefixSpec, PromptTooLongError, SamplingParams
from engine.core.errors import EngineDeadError, EngineUnavailableError
from engine.registry.registry import ReloadStatus, registry_digest
from engine.request_checker import RequestLimits
from replicas import client
from replicas.client import ReplicaSet, replica_fault
from replicas.replica import ModelFacts, ReplicaReport
from tests.replicas.test_stats import stats

LIMITS = RequestLimits(vocab_size=512, max_model_len=256, block_size=4, num_usable_blocks=100)
SPEC = PrefixSpec(
    name="sys",
    description="",
    kind="text",
    messages=(),
    text="x",
    token_ids=(5, 6, 7, 8, 9),
    contract=PrefixContract(max_tokens=7),
)


@dataclass
class _Result:
    """A replica's answer (or exception), after `delay` seconds."""

    value: Any
    delay: float = 0.0

    def __await__(self) -> Any:
        return self.get_async().__await__()

    async def get_async(self) -> Any:
        await asyncio.sleep(self.delay)
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


class _Broadcast:
    def __init__(self, results: list[_Result]) -> None:
        self.results = results

    async def _fetch_replica_results_async(self) -> list[_Result]:
        return self.results

    async def results_async(self, return_exceptions: bool = False) -> list[Any]:
        assert return_exceptions
        return [r.value for r in self.results]


class FakeHandle:
    """What ReplicaSet asks of Serve's handle outside requests: `facts`, `explain` and the
    `report` and `reload` broadcasts. `facts_answers`: what the first calls of `facts` give
    (an exception, or a delay past the timeout) before the facts."""

    def __init__(
        self,
        facts: ModelFacts,
        reports: list[ReplicaReport | BaseException],
        facts_answers: list[_Result] | None = None,
        explain: _Result | None = None,
    ) -> None:
        self.facts_ = facts
        self.reports = reports
        self.facts_answers = list(facts_answers or [])
        self.explain_ = explain
        self.known_digests: list[str | None] = []
        self.delays: dict[str, float] = {}
        self.reloads: list[tuple[str, ReloadStatus]] = []

    @property
    def facts(self) -> Any:
        answers, facts = self.facts_answers, self.facts_

        class _Method:
            def remote(self) -> _Result:
                return answers.pop(0) if answers else _Result(facts)

        return _Method()

    @property
    def explain(self) -> Any:
        answer = self.explain_

        class _Method:
            def remote(self, *args: Any) -> _Result:
                assert answer is not None
                return answer

        return _Method()

    def broadcast(self, method: str, known_digest: str | None = None) -> _Broadcast:
        if method == "reload":
            return _Broadcast([_Result(answer) for answer in self.reloads])
        assert method == "report"
        self.known_digests.append(known_digest)
        return _Broadcast(
            [
                _Result(
                    r
                    if isinstance(r, BaseException) or r.specs_digest != known_digest
                    else replace(r, specs=None),
                    0.0 if isinstance(r, BaseException) else self.delays.get(r.name, 0.0),
                )
                for r in self.reports
            ]
        )


def report(
    name: str, digest: str = "d1", specs: tuple[PrefixSpec, ...] = (SPEC,), **changes: Any
) -> ReplicaReport:
    limits = changes.pop("limits", LIMITS)
    pid = changes.pop("pid", 1000)
    return ReplicaReport(
        name, stats(registry_digest=digest, **changes), limits, registry_digest(specs), specs, pid
    )


@pytest.fixture
def facts(tiny_tokenizer: Any) -> ModelFacts:
    return ModelFacts("tiny", tiny_tokenizer, frozenset({0}), LIMITS)


def replica_set(facts: ModelFacts, reports: list[ReplicaReport | BaseException]) -> ReplicaSet:
    """A ReplicaSet that heard the replicas once (its poll loop lives and dies with the
    event loop `asyncio.run` made)."""
    replicas = ReplicaSet(FakeHandle(facts, reports), num_replicas=2, poll_interval=30.0)  # type: ignore[arg-type]
    asyncio.run(replicas.open())
    return replicas


def health(replicas: ReplicaSet) -> tuple[str | None, str | None]:
    state = replicas.health()
    return state.problem, state.degraded


def test_healthy_when_every_replica_holds_the_same_registry(facts: ModelFacts) -> None:
    replicas = replica_set(facts, [report("a"), report("b")])
    try:
        assert health(replicas) == (None, None)
        assert [s.name for s in replicas.replica_states()] == ["a", "b"]
        assert replicas.stats().num_kv_blocks == 200
    finally:
        replicas.shutdown()


class _Stream:
    """A replica's stream as Serve's handle gives it: the replica's name, then what the test
    puts on `outputs` (None ends it; an exception is raised there)."""

    def __init__(self, replica: str) -> None:
        self.replica = replica
        self.outputs: asyncio.Queue[Any] = asyncio.Queue()
        self.named = False

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> Any:
        if not self.named:
            self.named = True
            return self.replica
        item = await self.outputs.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        pass


class _StreamingHandle(FakeHandle):
    """Serve puts each request on the replica named in `takers`, in order, whatever the
    ingress chose (as it does when the chosen replica's queue is full)."""

    def __init__(self, *args: Any, takers: list[str]) -> None:
        super().__init__(*args)
        self.takers = takers
        self.streams: list[_Stream] = []

    def options(self, **_: Any) -> Any:
        handle = self

        class _Generate:
            def remote(self, *args: Any) -> _Stream:
                handle.streams.append(_Stream(handle.takers.pop(0)))
                return handle.streams[-1]

        class _Options:
            generate = _Generate()

        return _Options()


def test_the_listing_names_each_replicas_process_and_what_it_streams_now(
    facts: ModelFacts,
) -> None:
    """`streaming` counts the requests a replica took and that have not ended, as the ingress
    sees them now: where Serve put them (not where the ingress asked), and a request that
    ended, whose replica died or whose client left no longer counts."""

    async def run() -> None:
        handle = _StreamingHandle(
            facts, [report("a", pid=11), report("b", pid=22)], takers=["b", "b", "b"]
        )
        replicas = ReplicaSet(handle, num_replicas=2, poll_interval=30.0)  # type: ignore[arg-type]
        await replicas.open()
        try:
            request = replicas.prepare_request([1, 2, 3], SamplingParams(max_tokens=3))

            def streaming() -> list[tuple[str, int | None, int]]:
                return [(s.name, s.pid, s.streaming) for s in replicas.replica_states()]

            assert streaming() == [("a", 11, 0), ("b", 22, 0)]
            generators = [replicas.generate(request) for _ in range(3)]
            pulls = [asyncio.ensure_future(g.__anext__()) for g in generators]
            while len(handle.streams) < 3:
                await asyncio.sleep(0)
            for stream in handle.streams:
                stream.outputs.put_nowait(SimpleNamespace(finished=False))
            await asyncio.gather(*pulls)
            assert streaming() == [("a", 11, 0), ("b", 22, 3)]
            handle.streams[0].outputs.put_nowait(None)  # ended
            handle.streams[2].outputs.put_nowait(ActorDiedError())  # its replica died
            with contextlib.suppress(StopAsyncIteration):
                await generators[0].__anext__()
            with pytest.raises(EngineUnavailableError):
                await generators[2].__anext__()
            assert streaming() == [("a", 11, 0), ("b", 22, 1)]
            await generators[1].aclose()  # the client went away
            assert streaming() == [("a", 11, 0), ("b", 22, 0)]
        finally:
            replicas.shutdown()

    asyncio.run(run())


@pytest.mark.parametrize(
    ("reports", "problem"),
    [
        ([report("a"), report("b", is_reload_pending=True)], "replicas loading prefixes: b"),
        ([report("a"), report("b", "d2")], "the replicas hold different registries (a=d1, b=d2)"),
        ([RuntimeError("gone"), RuntimeError("gone too")], "no engine replica answers"),
    ],
)
def test_unhealthy_until_the_replicas_agree(
    facts: ModelFacts, reports: list[ReplicaReport | BaseException], problem: str
) -> None:
    replicas = replica_set(facts, reports)
    try:
        assert health(replicas) == (problem, None)
        assert replicas.is_running  # requests still flow to the replicas that serve
    finally:
        replicas.shutdown()


@pytest.mark.parametrize(
    "reports", [[report("a")], [report("a"), RuntimeError("gone")]], ids=["restarting", "failed"]
)
def test_a_missing_replica_degrades_but_the_others_serve(
    facts: ModelFacts, reports: list[ReplicaReport | BaseException]
) -> None:
    """A replica Serve is restarting (not in the broadcast) or that failed its report: the
    others serve the one registry, so /health stays 200 and says what is short."""
    replicas = replica_set(facts, reports)
    try:
        assert health(replicas) == (None, "1 of 2 engine replicas serve")
    finally:
        replicas.shutdown()


def test_a_replica_that_did_not_answer_is_listed_with_its_error(facts: ModelFacts) -> None:
    replicas = replica_set(facts, [report("a"), RuntimeError("gone")])
    try:
        states = replicas.replica_states()
        assert [(s.name, s.stats is None) for s in states] == [("a", False), ("?", True)]
        assert "gone" in (states[1].error or "")
    finally:
        replicas.shutdown()


def test_requests_are_checked_against_the_tightest_replica(facts: ModelFacts) -> None:
    small = replace(LIMITS, num_usable_blocks=10)  # 40 tokens of KV beside its prefixes
    replicas = replica_set(facts, [report("a"), report("b", limits=small)])
    try:
        replicas.prepare_request([1, 2, 3], SamplingParams(max_tokens=30))
        with pytest.raises(PromptTooLongError, match="only 40 fit"):
            replicas.prepare_request([1, 2, 3], SamplingParams(max_tokens=60))
    finally:
        replicas.shutdown()


def test_contracts_come_from_the_entries_the_replicas_accepted(facts: ModelFacts) -> None:
    replicas = replica_set(facts, [report("a"), report("b")])
    try:
        assert replicas.prefix_contract([5, 6, 7, 8, 9, 10]) == SPEC.contract
        assert replicas.prefix_contract([5, 6, 7, 1]) is None
    finally:
        replicas.shutdown()


def test_a_silent_replica_is_listed_and_the_others_still_count(facts: ModelFacts) -> None:
    handle = FakeHandle(facts, [report("a"), report("b")])
    handle.delays["b"] = 5.0  # past the poll's 2 s
    replicas = ReplicaSet(handle, num_replicas=2, poll_interval=0.1)  # type: ignore[arg-type]
    try:
        asyncio.run(replicas.open())
        states = replicas.replica_states()
        assert [s.name for s in states] == ["a", "?"]
        assert "did not answer within 2 s" in (states[1].error or "")
        assert health(replicas) == (None, "1 of 2 engine replicas serve")
    finally:
        replicas.shutdown()


@pytest.mark.parametrize(("reporting", "expected_polls"), [(["a"], range(2, 8)), (["a", "b"], [0])])
def test_a_missing_replica_is_looked_for_every_tenth_of_a_second(
    facts: ModelFacts, reporting: list[str], expected_polls: range | list[int]
) -> None:
    """Requests go to the replicas the last poll heard from: while one of two is missing,
    its replacement is looked for every 0.1 s, not every `poll_interval` (30 s here)."""
    handle = FakeHandle(facts, [report(name) for name in reporting])
    replicas = ReplicaSet(handle, num_replicas=2, poll_interval=30.0)  # type: ignore[arg-type]

    async def open_and_wait() -> None:
        await replicas.open()  # its own poll, then the loop's
        await asyncio.sleep(0.55)

    try:
        asyncio.run(open_and_wait())
        # ~5 polls in 0.55 s while one is missing (2 at least on a busy machine), none more
        # than open's own while both report
        assert len(handle.known_digests) - 1 in expected_polls
    finally:
        replicas.shutdown()


def test_a_replica_missing_for_good_is_looked_for_at_the_usual_interval_again(
    facts: ModelFacts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast polls last `DEGRADED_POLL_WINDOW` (0.2 s here), then `poll_interval` again."""
    monkeypatch.setattr(client, "DEGRADED_POLL_WINDOW", 0.2)
    handle = FakeHandle(facts, [report("a")])
    replicas = ReplicaSet(handle, num_replicas=2, poll_interval=30.0)  # type: ignore[arg-type]

    async def open_and_wait() -> None:
        await replicas.open()
        await asyncio.sleep(1.0)

    try:
        asyncio.run(open_and_wait())
        assert len(handle.known_digests) - 1 in range(1, 4)  # ~2 in the window, none after
    finally:
        replicas.shutdown()


def test_a_replica_that_stops_or_starts_reporting_is_logged(
    facts: ModelFacts, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator reads from the log when the set ran short and when it was whole again."""
    handle = FakeHandle(facts, [report("a"), report("b")])
    replicas = ReplicaSet(handle, num_replicas=2, poll_interval=30.0)  # type: ignore[arg-type]

    async def polls() -> None:
        await replicas.open()
        caplog.clear()
        await replicas._poll()  # nothing changed: no line
        handle.reports = [report("a"), RuntimeError("died")]
        await replicas._poll()
        await replicas._poll()  # still short: no second line
        handle.reports = [report("c"), report("a")]
        await replicas._poll()

    try:
        with caplog.at_level("INFO", logger=client.__name__):
            asyncio.run(polls())
        assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
            ("WARNING", "ingress: replica b stopped reporting; 1 of 2 engine replicas serve"),
            ("INFO", "ingress: replica c reports; 2 of 2 engine replicas serve"),
        ]
    finally:
        replicas.shutdown()


def test_entries_are_sent_once_and_taken_from_most_replicas(facts: ModelFacts) -> None:
    other = replace(SPEC, name="other", token_ids=(1, 2, 3, 4, 5))
    handle = FakeHandle(facts, [report("a", specs=(other,)), report("b"), report("c")])
    replicas = ReplicaSet(handle, num_replicas=3, poll_interval=30.0)  # type: ignore[arg-type]

    async def two_polls() -> None:
        await replicas.open()
        await replicas._poll()

    try:
        asyncio.run(two_polls())
        # b and c hold SPEC: its contract answers, whatever order the reports came in.
        assert replicas.prefix_contract([5, 6, 7, 8, 9, 10]) == SPEC.contract
        assert replicas.prefix_contract([1, 2, 3, 4, 5, 6]) is None
        assert handle.known_digests == [None, registry_digest([SPEC])]
    finally:
        replicas.shutdown()


def test_a_tie_keeps_the_entries_held_and_does_not_flip(facts: ModelFacts) -> None:
    other = replace(SPEC, name="other", token_ids=(1, 2, 3, 4, 5))
    handle = FakeHandle(facts, [report("a"), report("b")])
    replicas = ReplicaSet(handle, num_replicas=2, poll_interval=30.0)  # type: ignore[arg-type]

    async def reload_half_way() -> None:
        await replicas.open()
        for order in (
            [report("b", specs=(other,)), report("a")],
            [report("a"), report("b", specs=(other,))],
        ):
            handle.reports = order
            await replicas._poll()
            assert replicas.prefix_contract([5, 6, 7, 8, 9, 10]) == SPEC.contract
        handle.reports = [report("a", specs=(other,)), report("b", specs=(other,))]
        await replicas._poll()

    try:
        asyncio.run(reload_half_way())
        assert replicas.prefix_contract([1, 2, 3, 4, 5, 6]) == other.contract
        assert replicas.prefix_contract([5, 6, 7, 8, 9, 10]) is None
    finally:
        replicas.shutdown()


def test_open_waits_for_replicas_that_are_slow_or_restarting(facts: ModelFacts) -> None:
    """No replica yet (Serve has none), then one too slow for the timeout: the ingress asks
    again until one answers instead of staying unconnected."""
    answers = [
        _Result(DeploymentUnavailableError(DeploymentID("engine"))),
        _Result(facts, delay=5.0),
    ]
    handle = FakeHandle(facts, [report("a"), report("b")], facts_answers=answers)
    replicas = ReplicaSet(handle, num_replicas=2, request_timeout=0.2, poll_interval=30.0)  # type: ignore[arg-type]
    try:
        asyncio.run(replicas.open())
        assert replicas.is_running and replicas.model_name == "tiny"
        assert handle.facts_answers == []
    finally:
        replicas.shutdown()


def test_open_raises_what_is_not_a_replica_fault(facts: ModelFacts) -> None:
    handle = FakeHandle(facts, [], facts_answers=[_Result(TypeError("bad facts"))])
    replicas = ReplicaSet(handle, num_replicas=2, poll_interval=30.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bad facts"):
        asyncio.run(replicas.open())


@pytest.mark.parametrize(
    ("exc", "fault"),
    [
        (EngineDeadError("stopped"), "its engine stopped"),
        (
            RayTaskError("explain", "tb", EngineDeadError("x")).as_instanceof_cause(),
            "its engine stopped",
        ),
        (ObjectLostError("0" * 56, "owner", "call site"), "ObjectLostError"),
        (ActorDiedError(), "ActorDiedError"),
        (BackPressureError(num_queued_requests=3, max_queued_requests=2), "BackPressureError"),
        (RayTaskError("explain", "tb", ValueError("x")).as_instanceof_cause(), None),
        (ValueError("x"), None),
    ],
)
def test_replica_faults_are_told_from_the_replicas_own_errors(
    exc: BaseException, fault: str | None
) -> None:
    assert replica_fault(exc) == fault


def test_explain_maps_a_fault_and_silence_to_unavailable(facts: ModelFacts) -> None:
    for answer, message in [
        (_Result(ActorDiedError()), "ActorDiedError"),
        (_Result(None, delay=5.0), "no answer within 0.2 s"),
    ]:
        handle = FakeHandle(facts, [report("a"), report("b")], explain=answer)
        replicas = ReplicaSet(handle, num_replicas=2, request_timeout=0.2, poll_interval=30.0)  # type: ignore[arg-type]

        try:
            with pytest.raises(EngineUnavailableError, match=re.escape(message)):
                asyncio.run(_open_and_explain(replicas))
        finally:
            replicas.shutdown()


async def _open_and_explain(replicas: ReplicaSet) -> None:
    await replicas.open()
    await replicas.explain_prefix_match([1, 2, 3])


def test_a_reload_answers_once_the_replicas_report_its_outcome(facts: ModelFacts) -> None:
    """An operator lists the registry right after a failed reload: each replica's card must
    show that failure, not the state the last poll saw (30 s ago here, at the usual
    interval) before it."""
    handle = FakeHandle(facts, [report("a"), report("b")])
    replicas = ReplicaSet(handle, num_replicas=2, poll_interval=30.0)  # type: ignore[arg-type]
    failed = ReloadStatus(time=99.0, ok=False, error="bad yaml", num_prefixes=1)

    async def reload() -> tuple[ReloadStatus, list[bool | None]]:
        await replicas.open()
        handle.reports = [
            report(name, last_reload_ok=False, last_reload_error="bad yaml") for name in "ab"
        ]
        handle.reloads = [("a", failed), ("b", failed)]
        status = await replicas.reload_prefixes()
        return status, [
            s.stats.last_reload_ok if s.stats else None for s in replicas.replica_states()
        ]

    try:
        status, oks = asyncio.run(reload())
        assert status.ok is False
        assert status.error == "replica a: bad yaml; replica b: bad yaml"
        assert oks == [False, False]
        assert replicas.stats().last_reload_ok is False
    finally:
        replicas.shutdown()
