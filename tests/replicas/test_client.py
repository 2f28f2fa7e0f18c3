"""ReplicaSet at the ingress, over a stand-in for Serve's handle: health from the replicas'
reports, validation against the tightest replica, contracts from the replicas' entries."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

import pytest

from engine import PrefixContract, PrefixSpec, PromptTooLongError, SamplingParams
from engine.registry import registry_digest
from engine.request_checker import RequestLimits
from replicas.client import ReplicaSet
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
    value: Any

    def __await__(self) -> Any:
        return self._value().__await__()

    async def _value(self) -> Any:
        return self.value

    async def results_async(self, return_exceptions: bool = False) -> Any:
        return self.value


class FakeHandle:
    """What ReplicaSet asks of Serve's handle outside requests: `facts` and `report`."""

    def __init__(self, facts: ModelFacts, reports: list[ReplicaReport | BaseException]) -> None:
        self.facts_ = facts
        self.reports = reports

    @property
    def facts(self) -> Any:
        facts = self.facts_

        class _Method:
            def remote(self) -> _Result:
                return _Result(facts)

        return _Method()

    def broadcast(self, method: str) -> _Result:
        assert method == "report"
        return _Result(list(self.reports))


def report(name: str, digest: str = "d1", **changes: Any) -> ReplicaReport:
    limits = changes.pop("limits", LIMITS)
    return ReplicaReport(
        name,
        stats(registry_digest=digest, **changes),
        limits,
        registry_digest([SPEC]),
        (SPEC,),
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


def test_healthy_when_every_replica_holds_the_same_registry(facts: ModelFacts) -> None:
    replicas = replica_set(facts, [report("a"), report("b")])
    try:
        assert replicas.health_problem() is None
        assert [s.name for s in replicas.replica_states()] == ["a", "b"]
        assert replicas.stats().num_kv_blocks == 200
    finally:
        replicas.shutdown()


@pytest.mark.parametrize(
    ("reports", "problem"),
    [
        ([report("a")], "1 of 2 engine replicas serve"),
        ([report("a"), RuntimeError("gone")], "1 of 2 engine replicas serve"),
        ([report("a"), report("b", is_reload_pending=True)], "replicas loading prefixes: b"),
        ([report("a"), report("b", "d2")], "the replicas hold different registries (a=d1, b=d2)"),
    ],
)
def test_unhealthy_until_all_replicas_agree(
    facts: ModelFacts, reports: list[ReplicaReport | BaseException], problem: str
) -> None:
    replicas = replica_set(facts, reports)
    try:
        assert replicas.health_problem() == problem
        assert replicas.is_running  # requests still flow to the replicas that serve
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
