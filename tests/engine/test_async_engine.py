"""AsyncEngine on the tiny Llama: streaming, concurrency, cancellation, typed errors, failures.

Every test drives a real engine thread from `asyncio.run` and bounds the whole coroutine with
`asyncio.wait_for`, so a hang fails the test instead of blocking the suite. Ordering between
the test and the engine thread is made deterministic with two tools instead of sleeps:
`_paused` blocks the engine thread inside a command (commands run in FIFO order, so everything
submitted meanwhile is applied together before the next step), and `StepGate` blocks a chosen
forward pass until the test releases it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from transformers import PreTrainedTokenizerFast

from engine import (
    EngineConfig,
    EngineDeadError,
    InvalidRequestError,
    LLMEngine,
    PromptTooLongError,
    RequestFailedError,
    RequestOutput,
    SamplingParams,
)
from engine.async_engine import AsyncEngine
from engine.scheduler.scheduler import SchedulerOutput
from engine.text.detokenizer import DetokenizerDelta, IncrementalDetokenizer

T = TypeVar("T")
TIMEOUT_S = 60.0
ENGINE_THREAD = "prefixgate-engine"
_TEXT = " ".join(
    [
        "The quick brown fox jumps over the lazy dog.",
        "A paged key-value cache stores attention keys and values in fixed-size blocks.",
        "The scheduler admits new requests when enough free blocks remain in the pool.",
        "Hello there! How are you today? I am fine, thank you for asking.",
        "Streaming responses send each new piece of text as soon as it is ready.",
    ]
    * 3
)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _config(path: Path, **overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = {
        "model": str(path),
        "dtype": "float32",
        "num_kv_blocks": 64,
        "block_size": 4,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_model_len": 256,  # the pool (64 blocks x 4) must hold one max_model_len sequence
        # One token a step: these tests count steps and deltas (drafts would join several
        # tokens a step; tests/engine/speculative/ covers them)
        "speculative": "off",
    }
    settings.update(overrides)
    return EngineConfig(**settings)


def _reference(path: Path, prompt: list[int], params: SamplingParams) -> list[int]:
    """What the synchronous engine generates for `prompt` alone, on a fresh engine."""
    return LLMEngine(_config(path)).generate([prompt], params)[0]


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


async def collect(
    engine: AsyncEngine, prompt: list[int], params: SamplingParams, request_id: str | None = None
) -> list[RequestOutput]:
    return [
        output
        async for output in engine.generate(engine.prepare_request(prompt, params), request_id)
    ]


def stream(
    engine: AsyncEngine, prompt: list[int], params: SamplingParams, request_id: str | None = None
) -> AsyncGenerator[RequestOutput, None]:
    """`generate()` as the async generator it is: callers rely on `aclose()` to abort."""
    agen = engine.generate(engine.prepare_request(prompt, params), request_id)
    assert isinstance(agen, AsyncGenerator)
    return agen


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for output in outputs for t in output.token_ids]


def _idle_state(async_engine: AsyncEngine) -> Callable[[LLMEngine], dict[str, Any]]:
    """A probe for `run_in_engine`: everything that must be true once no request is left."""

    def probe(e: LLMEngine) -> dict[str, Any]:
        e.check_integrity()
        return {
            "has_unfinished_requests": e.has_unfinished_requests(),
            "num_running": e.num_running,
            "num_waiting": e.num_waiting,
            "num_free_blocks": e.pool.num_free_blocks,
            # The async engine's own per-request map: a stream left behind is a leak.
            "num_streams": len(async_engine._streams),
        }

    return probe


async def assert_idle(engine: AsyncEngine) -> None:
    state = await engine.run_in_engine(_idle_state(engine))
    assert state == {
        "has_unfinished_requests": False,
        "num_running": 0,
        "num_waiting": 0,
        "num_free_blocks": engine.engine.pool.num_blocks,
        "num_streams": 0,
    }


@asynccontextmanager
async def _paused(engine: AsyncEngine) -> AsyncIterator[None]:
    """Hold the engine thread inside a command; what is submitted meanwhile lands at once."""
    release = threading.Event()
    held = asyncio.ensure_future(engine.run_in_engine(lambda e: release.wait(TIMEOUT_S)))
    try:
        yield
        await asyncio.sleep(0)  # tasks created in the block run up to their first await
    finally:
        release.set()
        assert await held is True


async def _start(coro: Awaitable[T]) -> asyncio.Task[T]:
    """Run a coroutine as a task up to its first suspension (e.g. a generate() submission)."""
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0)
    return task


class StepGate:
    """Wraps `runner.execute`: the first `num_free` forwards pass, the next one blocks.

    `blocked` is set when that forward is entered; `release()` lets it (and all later ones)
    through. The fixture releases it at teardown so a failing test never leaves the thread stuck.
    """

    def __init__(self, llm: LLMEngine, num_free: int) -> None:
        self.num_free = num_free
        self.num_calls = 0
        self.blocked = threading.Event()
        self._release = threading.Event()
        self._execute = llm.runner.execute

    def __call__(self, out: SchedulerOutput) -> Any:
        self.num_calls += 1
        if self.num_calls > self.num_free:
            self.blocked.set()
            self._release.wait(TIMEOUT_S)
        return self._execute(out)

    def release(self) -> None:
        self._release.set()

    async def wait_blocked(self) -> None:
        assert await asyncio.to_thread(self.blocked.wait, TIMEOUT_S)


@pytest.fixture
def prompt_ids(tiny_tokenizer: PreTrainedTokenizerFast) -> list[int]:
    ids: list[int] = tiny_tokenizer.encode(_TEXT)
    assert len(ids) >= 150
    return ids


@pytest.fixture
def make_engine(tiny_llama_path: Path) -> Iterator[Callable[..., AsyncEngine]]:
    engines: list[AsyncEngine] = []

    def make(**overrides: Any) -> AsyncEngine:
        config = _config(tiny_llama_path, **overrides)
        engine = AsyncEngine(config, engine=LLMEngine(config))
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
        assert not engine._thread.is_alive()


@pytest.fixture
def engine(make_engine: Callable[..., AsyncEngine]) -> AsyncEngine:
    return make_engine()


@pytest.fixture
def gate(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> Iterator[StepGate]:
    """Two forwards pass (the prefill and one decode of a short prompt), the third blocks."""
    step_gate = StepGate(engine.engine, num_free=2)
    monkeypatch.setattr(engine.engine.runner, "execute", step_gate)
    yield step_gate
    step_gate.release()


# -- streaming ----------------------------------------------------------------------------------
def test_generate_streams_the_synchronous_greedy_tokens(
    engine: AsyncEngine,
    tiny_llama_path: Path,
    tiny_tokenizer: PreTrainedTokenizerFast,
    prompt_ids: list[int],
) -> None:
    prompt, params = prompt_ids[:10], greedy(12)
    expected = _reference(tiny_llama_path, prompt, params)
    assert len(expected) == 12

    outputs = run(collect(engine, prompt, params, request_id="stream-1"))

    assert _tokens(outputs) == expected
    assert [o.token_ids for o in outputs] == [[t] for t in expected]  # one delta per step
    assert [o.request_id for o in outputs] == ["stream-1"] * 12
    assert [o.finish_reason for o in outputs] == [None] * 11 + ["length"]
    assert [o.num_completion_tokens for o in outputs] == list(range(1, 13))
    assert [o.num_prompt_tokens for o in outputs] == [10] * 12
    assert [o.error for o in outputs] == [None] * 12
    expected_text = tiny_tokenizer.decode(
        expected, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    assert "".join(o.text for o in outputs) == expected_text
    run(assert_idle(engine))


def test_generate_assigns_distinct_request_ids(engine: AsyncEngine, prompt_ids: list[int]) -> None:
    async def scenario() -> list[list[RequestOutput]]:
        return list(
            await asyncio.gather(*(collect(engine, prompt_ids[:5], greedy(2)) for _ in "ab"))
        )

    first, second = run(scenario())
    assert len({o.request_id for o in first}) == 1
    assert len({o.request_id for o in second}) == 1
    assert first[0].request_id != second[0].request_id
    assert _tokens(first) == _tokens(second)


def test_concurrent_requests_match_each_request_run_alone(
    engine: AsyncEngine, tiny_llama_path: Path, prompt_ids: list[int]
) -> None:
    # (offset, prompt length, max_tokens): the 70-token prompt is prefilled in two chunks
    # (max_num_batched_tokens=64); together they need 50 of the 64 blocks, so no preemption.
    shapes = [(0, 1, 7), (3, 5, 12), (11, 12, 3), (20, 23, 9), (40, 40, 5), (60, 70, 6)]
    prompts = [prompt_ids[off : off + n] for off, n, _ in shapes]
    params = [greedy(m) for _, _, m in shapes]
    expected = [_reference(tiny_llama_path, p, sp) for p, sp in zip(prompts, params, strict=True)]

    async def scenario() -> list[list[RequestOutput]]:
        streams = (
            collect(engine, p, sp, request_id=f"c{i}")
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        )
        results = await asyncio.gather(*streams)
        await assert_idle(engine)
        return list(results)

    results = run(scenario())

    assert [_tokens(r) for r in results] == expected
    assert [len(r) for r in results] == [m for _, _, m in shapes]
    for i, (outputs, (_, n, m)) in enumerate(zip(results, shapes, strict=True)):
        assert {o.request_id for o in outputs} == {f"c{i}"}
        last = outputs[-1]
        assert (last.finish_reason, last.num_completion_tokens, last.num_prompt_tokens) == (
            "length",
            m,
            n,
        )


def test_concurrent_requests_admitted_in_one_step_match_run_alone(
    engine: AsyncEngine, tiny_llama_path: Path, prompt_ids: list[int]
) -> None:
    prompts = [prompt_ids[i * 10 : i * 10 + 4 + i] for i in range(6)]
    params = greedy(8)
    expected = [_reference(tiny_llama_path, p, params) for p in prompts]

    async def scenario() -> list[list[RequestOutput]]:
        async with _paused(engine):
            tasks = [asyncio.ensure_future(collect(engine, p, params)) for p in prompts]
        return list(await asyncio.gather(*tasks))

    assert [_tokens(r) for r in run(scenario())] == expected
    run(assert_idle(engine))


# -- cancellation -------------------------------------------------------------------------------
def test_closing_the_iterator_mid_stream_aborts_the_request(
    engine: AsyncEngine, gate: StepGate, prompt_ids: list[int]
) -> None:
    async def scenario() -> list[RequestOutput]:
        agen = stream(engine, prompt_ids[:10], greedy(100), request_id="closed")
        received = [await agen.__anext__(), await agen.__anext__()]
        await gate.wait_blocked()  # the third forward is running: the request is in flight
        await agen.aclose()  # submits the abort, which the engine applies after that forward
        gate.release()
        assert await engine.run_in_engine(lambda e: e.scheduler.find("closed")) is None
        await assert_idle(engine)
        return received

    received = run(scenario())
    assert [o.finish_reason for o in received] == [None, None]
    assert engine.engine.num_steps == 3  # aborted right after the gated forward, not later


def test_breaking_out_of_async_for_then_aclose_aborts(
    engine: AsyncEngine, gate: StepGate, prompt_ids: list[int]
) -> None:
    async def scenario() -> int:
        agen = stream(engine, prompt_ids[:10], greedy(100), request_id="broken")
        num_received = 0
        async for _ in agen:
            num_received += 1
            if num_received == 2:
                break
        await gate.wait_blocked()
        await agen.aclose()
        gate.release()
        await assert_idle(engine)
        return num_received

    assert run(scenario()) == 2
    assert engine.engine.num_steps == 3


def test_cancelling_the_consuming_task_aborts_the_request(
    engine: AsyncEngine, gate: StepGate, prompt_ids: list[int]
) -> None:
    received: list[RequestOutput] = []

    async def consume() -> None:
        async for output in engine.generate(
            engine.prepare_request(prompt_ids[:10], greedy(100)), request_id="cancelled"
        ):
            received.append(output)

    async def scenario() -> None:
        task = asyncio.ensure_future(consume())
        await gate.wait_blocked()  # two outputs delivered, the third forward is held
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.release()
        assert await engine.run_in_engine(lambda e: e.scheduler.find("cancelled")) is None
        await assert_idle(engine)

    run(scenario())
    assert [o.num_completion_tokens for o in received] == [1, 2]
    assert engine.engine.num_steps == 3


def test_cancelling_before_admission_never_runs_the_request(
    engine: AsyncEngine, prompt_ids: list[int]
) -> None:
    async def scenario() -> None:
        async with _paused(engine):
            task = await _start(collect(engine, prompt_ids[:10], greedy(100), request_id="early"))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await assert_idle(engine)

    run(scenario())
    assert engine.engine.num_steps == 0  # the add and the abort were applied back to back


def test_cancelling_one_request_leaves_the_others_intact(
    engine: AsyncEngine, tiny_llama_path: Path, gate: StepGate, prompt_ids: list[int]
) -> None:
    kept_prompt, params = prompt_ids[30:37], greedy(6)
    expected = _reference(tiny_llama_path, kept_prompt, params)

    async def scenario() -> list[RequestOutput]:
        async with _paused(engine):  # both admitted in the same step
            doomed = asyncio.ensure_future(collect(engine, prompt_ids[:10], greedy(100)))
            kept = asyncio.ensure_future(collect(engine, kept_prompt, params))
        await gate.wait_blocked()
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        gate.release()
        outputs = await kept
        await assert_idle(engine)
        return outputs

    outputs = run(scenario())
    assert _tokens(outputs) == expected
    assert outputs[-1].finish_reason == "length"


# -- bad requests -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompt", "error", "message"),
    [
        ([], InvalidRequestError, "the prompt must contain at least one token"),
        ([1, 512], InvalidRequestError, "token ids must be in [0, 512)"),
        ([1, 10_000], InvalidRequestError, "token ids must be in [0, 512)"),
        ([-1, 3], InvalidRequestError, "token ids must be in [0, 512)"),
    ],
    ids=["empty", "vocab-size", "far-out-of-vocab", "negative"],
)
def test_invalid_prompt_is_refused_by_prepare_and_engine_keeps_serving(
    engine: AsyncEngine,
    tiny_llama_path: Path,
    prompt_ids: list[int],
    prompt: list[int],
    error: type[Exception],
    message: str,
) -> None:
    good_prompt, params = prompt_ids[:6], greedy(5)
    expected = _reference(tiny_llama_path, good_prompt, params)

    async def scenario() -> list[RequestOutput]:
        with pytest.raises(error) as info:
            engine.prepare_request(prompt, greedy(4))
        assert type(info.value) is error
        assert str(info.value) == message
        assert info.value.param == "prompt"  # type: ignore[attr-defined]
        return await collect(engine, good_prompt, params)

    assert _tokens(run(scenario())) == expected
    run(assert_idle(engine))


def test_prompt_plus_max_tokens_over_max_model_len_raises_prompt_too_long(
    make_engine: Callable[..., AsyncEngine], tiny_llama_path: Path, prompt_ids: list[int]
) -> None:
    engine = make_engine(max_model_len=64)

    async def scenario() -> tuple[PromptTooLongError, list[RequestOutput]]:
        with pytest.raises(PromptTooLongError) as info:
            await collect(engine, prompt_ids[:50], greedy(15))
        fits = await collect(engine, prompt_ids[:50], greedy(14))  # exactly 64 tokens
        return info.value, fits

    error, fits = run(scenario())
    assert str(error) == (
        "This model's maximum context length is 64 tokens. However, you requested 65 tokens "
        "(50 in the prompt, 15 in the completion). Please reduce the length of the prompt or "
        "max_tokens."
    )
    assert (error.num_prompt_tokens, error.max_model_len, error.param) == (50, 64, "max_tokens")
    assert (
        _tokens(fits)
        == LLMEngine(_config(tiny_llama_path, max_model_len=64)).generate(
            [prompt_ids[:50]], greedy(14)
        )[0]
    )
    assert (fits[-1].finish_reason, fits[-1].num_completion_tokens) == ("length", 14)
    run(assert_idle(engine))


def test_duplicate_request_id_fails_alone(
    engine: AsyncEngine, tiny_llama_path: Path, gate: StepGate, prompt_ids: list[int]
) -> None:
    """The duplicate is rejected on the engine thread; its error travels through its stream."""
    prompt, params = prompt_ids[:10], greedy(6)
    expected = _reference(tiny_llama_path, prompt, params)

    async def scenario() -> list[RequestOutput]:
        original = asyncio.ensure_future(collect(engine, prompt, params, request_id="dup"))
        await gate.wait_blocked()
        duplicate = await _start(collect(engine, prompt_ids[:3], greedy(2), request_id="dup"))
        gate.release()
        with pytest.raises(InvalidRequestError, match=r"^duplicate request id 'dup'$"):
            await duplicate
        outputs = await original
        await assert_idle(engine)
        return outputs

    outputs = run(scenario())
    assert _tokens(outputs) == expected
    assert outputs[-1].finish_reason == "length"


def test_cancelling_a_rejected_duplicate_leaves_the_original_running(
    engine: AsyncEngine, tiny_llama_path: Path, gate: StepGate, prompt_ids: list[int]
) -> None:
    prompt, params = prompt_ids[:10], greedy(6)
    expected = _reference(tiny_llama_path, prompt, params)

    async def scenario() -> list[RequestOutput]:
        original = asyncio.ensure_future(collect(engine, prompt, params, request_id="dup"))
        await gate.wait_blocked()
        duplicate = await _start(collect(engine, prompt_ids[:3], greedy(2), request_id="dup"))
        duplicate.cancel()  # before the engine thread has rejected it
        with pytest.raises(asyncio.CancelledError):
            await duplicate
        gate.release()
        return await original

    outputs = run(scenario())
    assert outputs[-1].finish_reason == "length"  # today: "abort", after 3 tokens
    assert _tokens(outputs) == expected


# -- failures inside the loop -------------------------------------------------------------------
def test_failing_forward_fails_requests_in_flight_and_loop_survives(
    engine: AsyncEngine,
    tiny_llama_path: Path,
    prompt_ids: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = engine.engine.runner
    execute = runner.execute
    failures: list[int] = []

    def fail_once(out: SchedulerOutput) -> Any:
        monkeypatch.setattr(runner, "execute", execute)  # the next forward runs normally
        failures.append(len(out.scheduled))
        raise RuntimeError("injected forward failure")

    good_prompt, params = prompt_ids[40:48], greedy(7)
    expected = _reference(tiny_llama_path, good_prompt, params)

    async def scenario() -> list[RequestOutput]:
        async with _paused(engine):  # install the failure and admit both before any step
            installed = asyncio.ensure_future(
                engine.run_in_engine(lambda e: monkeypatch.setattr(runner, "execute", fail_once))
            )
            first = asyncio.ensure_future(collect(engine, prompt_ids[:10], greedy(20)))
            second = asyncio.ensure_future(collect(engine, prompt_ids[10:15], greedy(20)))
        await installed
        for task in (first, second):
            with pytest.raises(RequestFailedError) as info:
                await task
            assert str(info.value) == "engine step failed: injected forward failure"
        await assert_idle(engine)
        assert engine.is_running
        outputs = await collect(engine, good_prompt, params)
        await assert_idle(engine)
        return outputs

    outputs = run(scenario())
    assert failures == [2]  # one forward raised, with both requests in its batch
    assert _tokens(outputs) == expected
    assert (outputs[-1].finish_reason, outputs[-1].num_completion_tokens) == ("length", 7)


def test_unusable_seed_is_rejected_before_the_engine() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(max_tokens=2, seed=2**64)
    assert (info.value.param, info.value.message) == ("seed", "seed must fit in int64")


def test_request_whose_admission_breaks_fails_alone(
    engine: AsyncEngine, prompt_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug while adding one request (here: its seeded generator cannot be made) fails that
    request with RequestFailedError; the loop and the next request are unaffected."""

    def broken_generator(seed: int, device: object) -> None:
        raise RuntimeError(f"no generator for seed {seed}")

    monkeypatch.setattr("engine.llm_engine.make_generator", broken_generator)

    async def scenario() -> list[RequestOutput]:
        with pytest.raises(RequestFailedError) as info:
            await collect(engine, prompt_ids[:4], SamplingParams(max_tokens=2, seed=7))
        assert str(info.value) == (
            "could not add the request: RuntimeError('no generator for seed 7')"
        )
        assert engine.is_running
        await assert_idle(engine)
        return await collect(engine, prompt_ids[:4], greedy(3))

    assert len(_tokens(run(scenario()))) == 3


def test_step_failing_after_a_request_finished_still_answers_it(
    engine: AsyncEngine, prompt_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    detokenize = IncrementalDetokenizer.step
    calls: list[int] = []

    def fail_second_call(self: IncrementalDetokenizer, token_id: int) -> DetokenizerDelta:
        calls.append(token_id)
        if len(calls) == 2:
            raise RuntimeError("injected detokenizer failure")
        return detokenize(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "step", fail_second_call)

    async def scenario() -> None:
        async with _paused(engine):  # both prefills in one step: "short" is appended first
            short = asyncio.ensure_future(collect(engine, prompt_ids[:6], greedy(1)))
            long = asyncio.ensure_future(collect(engine, prompt_ids[10:13], greedy(5)))
        with pytest.raises(RequestFailedError):
            await long
        await assert_idle(engine)  # today: the finished request's stream is still registered
        # The failure was the second token of the step: "short" finished before it.
        outputs = await short
        assert len(_tokens(outputs)) == 1
        assert outputs[-1].finish_reason == "length"

    run(scenario())


# -- run_in_engine ------------------------------------------------------------------------------
def test_run_in_engine_returns_the_value_on_the_engine_thread(engine: AsyncEngine) -> None:
    result = run(
        engine.run_in_engine(lambda e: (e.pool.num_blocks, threading.current_thread().name))
    )
    assert result == (64, ENGINE_THREAD)


def test_run_in_engine_propagates_the_exception_and_loop_survives(
    engine: AsyncEngine, prompt_ids: list[int]
) -> None:
    class Boom(Exception):
        pass

    def boom(e: LLMEngine) -> int:
        raise Boom("from the engine thread")

    async def scenario() -> list[RequestOutput]:
        with pytest.raises(Boom, match=r"^from the engine thread$"):
            await engine.run_in_engine(boom)
        assert engine.is_running
        return await collect(engine, prompt_ids[:4], greedy(3))

    assert len(_tokens(run(scenario()))) == 3
    run(assert_idle(engine))


# -- shutdown -----------------------------------------------------------------------------------
def test_after_shutdown_generate_and_run_in_engine_raise_engine_dead(
    engine: AsyncEngine, prompt_ids: list[int]
) -> None:
    engine.shutdown()
    assert not engine.is_running

    async def scenario() -> None:
        with pytest.raises(EngineDeadError):
            await collect(engine, prompt_ids[:4], greedy(3))
        with pytest.raises(EngineDeadError):
            await engine.run_in_engine(lambda e: None)

    run(scenario())
    engine.shutdown()  # idempotent


def test_shutdown_fails_the_requests_in_flight(
    engine: AsyncEngine, gate: StepGate, prompt_ids: list[int]
) -> None:
    async def scenario() -> list[RequestOutput]:
        received: list[RequestOutput] = []

        async def consume() -> None:
            async for output in engine.generate(
                engine.prepare_request(prompt_ids[:10], greedy(100))
            ):
                received.append(output)

        task = asyncio.ensure_future(consume())
        await gate.wait_blocked()
        engine.shutdown(timeout=0)  # only flags the stop: the loop is inside the held forward
        gate.release()
        with pytest.raises(EngineDeadError, match=r"^the engine is shutting down$"):
            await task
        return received

    received = run(scenario())
    engine.shutdown()
    assert [o.num_completion_tokens for o in received] == [1, 2, 3]
    assert not engine.is_running
    llm = engine.engine
    llm.check_integrity()
    assert not llm.has_unfinished_requests()
    assert llm.pool.num_free_blocks == llm.pool.num_blocks


def test_a_broken_loop_fails_requests_in_flight_then_refuses_new_ones(
    engine: AsyncEngine, prompt_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a BaseException escapes `_step`; the loop then dies, failing everyone once."""

    class LoopBreaker(BaseException):
        pass

    def break_loop(out: SchedulerOutput) -> Any:
        raise LoopBreaker("not an Exception")

    async def scenario() -> None:
        async with _paused(engine):
            installed = asyncio.ensure_future(
                engine.run_in_engine(lambda e: monkeypatch.setattr(e.runner, "execute", break_loop))
            )
            in_flight = asyncio.ensure_future(collect(engine, prompt_ids[:5], greedy(4)))
        await installed
        with pytest.raises(
            EngineDeadError, match=r"^the engine loop died: LoopBreaker\('not an Exception'\)$"
        ):
            await in_flight
        with pytest.raises(EngineDeadError):
            await collect(engine, prompt_ids[:5], greedy(4))
        with pytest.raises(EngineDeadError):
            await engine.run_in_engine(lambda e: None)

    run(scenario())
    assert not engine.is_running
    assert isinstance(engine._dead, LoopBreaker)
    llm = engine.engine
    llm.check_integrity()
    assert llm.pool.num_free_blocks == llm.pool.num_blocks


# -- text is the front end's ----------------------------------------------------------------
def test_text_is_made_off_the_engine_thread(
    engine: AsyncEngine, prompt_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Detokenizing and stop strings run where the stream is read, never between two forward
    passes on the engine thread."""
    threads: set[str] = set()
    detokenize = IncrementalDetokenizer.step

    def record(self: IncrementalDetokenizer, token_id: int) -> DetokenizerDelta:
        threads.add(threading.current_thread().name)
        return detokenize(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "step", record)
    outputs = run(collect(engine, prompt_ids[:6], greedy(4)))
    assert len(_tokens(outputs)) == 4
    assert threads == {threading.current_thread().name}
    assert ENGINE_THREAD not in threads


def test_a_stop_string_ends_the_stream_and_the_engine_lets_go_of_the_request(
    engine: AsyncEngine, prompt_ids: list[int], tiny_tokenizer: PreTrainedTokenizerFast
) -> None:
    full = run(collect(engine, prompt_ids[:6], greedy(12)))
    text = "".join(o.text for o in full)
    pieces = [o.text for o in full if o.text.strip()]
    stop = pieces[len(pieces) // 2]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])

    async def scenario() -> list[RequestOutput]:
        outputs = await collect(engine, prompt_ids[:6], params)
        await assert_idle(engine)  # aborted in the engine, blocks back in the pool
        return outputs

    outputs = run(scenario())
    assert "".join(o.text for o in outputs) == text[: text.index(stop)]
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", stop)
    assert _tokens(outputs) == _tokens(full)[: len(outputs)]
    assert len(outputs) < len(full)
