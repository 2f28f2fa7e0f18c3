"""EngineReplica's stream and report, over a stand-in engine (no Serve, no model)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from engine import RequestFailedError, RequestOutput, SamplingParams
from engine.registry.registry import registry_digest
from replicas.replica import EngineReplica
from tests.replicas.test_client import LIMITS, SPEC
from tests.replicas.test_stats import stats


def output(text: str, total: int, finish_reason: str | None = None) -> RequestOutput:
    return RequestOutput("r", text, [total], 7, total, 3, finish_reason)


class FakeEngine:
    """An AsyncEngine that streams `outputs`, then raises `error` if one is given."""

    def __init__(self, outputs: list[RequestOutput], error: Exception | None = None) -> None:
        self.outputs = outputs
        self.error = error
        self.engine = SimpleNamespace(prefixes=SimpleNamespace(specs=[SPEC]), limits=LIMITS)

    def prepare_request(self, ids: list[int], params: SamplingParams, *rest: Any) -> Any:
        return SimpleNamespace(prompt_token_ids=ids, params=params)

    async def generate(self, request: Any, request_id: str) -> AsyncIterator[RequestOutput]:
        for item in self.outputs:
            yield item
        if self.error is not None:
            raise self.error

    def stats(self) -> Any:
        return stats(registry_digest="d1")

    def shutdown(self) -> None:  # EngineReplica.__del__
        pass


def replica(engine: FakeEngine, stream_interval: int) -> EngineReplica:
    made = EngineReplica.__new__(EngineReplica)  # the constructor needs Serve and a model
    made.name, made.stream_interval, made.engine = "rep-a", stream_interval, engine  # type: ignore[assignment]
    made._specs_source, made._specs, made._specs_digest = None, (), registry_digest(())
    return made


def stream(made: EngineReplica) -> tuple[list[Any], BaseException | None]:
    """What the replica yields for one request, and what it raised after."""
    items: list[Any] = []

    async def consume() -> None:
        async for item in made.generate([1, 2, 3], SamplingParams(max_tokens=8), None, None, "r"):
            items.append(item)

    try:
        asyncio.run(consume())
    except Exception as exc:
        return items, exc
    return items, None


def test_tokens_are_gathered_and_the_first_and_last_go_at_once() -> None:
    outputs = [output("a", 1), output("b", 2), output("c", 3), output("d", 4, "length")]
    items, error = stream(replica(FakeEngine(outputs), stream_interval=2))
    assert error is None
    assert items[0] == "rep-a"
    assert [(o.text, o.token_ids) for o in items[1:]] == [("a", [1]), ("bc", [2, 3]), ("d", [4])]
    assert items[-1].finish_reason == "length"


def test_tokens_gathered_before_a_failure_still_go_out() -> None:
    outputs = [output("a", 1), output("b", 2), output("c", 3)]
    failure = RequestFailedError("the step failed")
    items, error = stream(replica(FakeEngine(outputs, failure), stream_interval=4))
    assert error is failure
    assert [(o.text, o.token_ids) for o in items[1:]] == [("a", [1]), ("bc", [2, 3])]


@pytest.mark.parametrize(
    ("known", "sent"), [(None, (SPEC,)), ("other", (SPEC,)), (registry_digest([SPEC]), None)]
)
def test_a_report_carries_the_entries_only_when_the_ingress_lacks_them(
    known: str | None, sent: tuple[Any, ...] | None
) -> None:
    report = replica(FakeEngine([]), stream_interval=1).report(known)
    assert report.specs_digest == registry_digest([SPEC])
    assert report.specs == sent
    assert (report.name, report.limits) == ("rep-a", LIMITS)
