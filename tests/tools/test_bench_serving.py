"""tools/bench_serving.py and tools/workloads.py against a tiny fake OpenAI SSE server.

The fake server is a raw HTTP/1.1 responder (asyncio.start_server) on 127.0.0.1 in its own
thread and event loop, so that both the async run functions and the synchronous `main()`
can drive it. It streams `num_chunks` one-token chunks with a small delay, then a usage
chunk and `data: [DONE]`; it can fail chosen requests (by arrival order) with an HTTP error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tools import bench_serving as bs
from tools.workloads import (
    DEFAULT_MAX_TOKENS,
    ApproxTokenizer,
    WorkloadRequest,
    build_workload,
    customer_message,
    intent_messages,
)

REPO = Path(__file__).resolve().parents[2]
SYSTEM = [{"role": "system", "content": "You are a classifier. Answer with one label."}]


# ---------------------------------------------------------------- the fake server


@dataclass
class FakeServer:
    num_chunks: int = 5
    delay_s: float = 0.002
    prompt_tokens: int = 11
    cached_tokens: int | None = 7
    include_usage: bool = True
    fail: dict[int, int] = field(default_factory=dict)  # arrival number -> HTTP status
    bad_event_at: int | None = None  # arrival number whose 3rd event is `bad_event`
    bad_event: str = '{"error": {"message": "engine failed", "code": 500}}'
    bodies: list[dict[str, Any]] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    port: int = 0
    _server: asyncio.Server | None = None
    _handlers: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._handlers:
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while request := await _read_request(reader):
                path, authorization, body = request
                self.authorizations.append(authorization)
                if path.endswith("/models"):
                    models = {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}
                    await _respond(writer, 200, models)
                else:
                    await self._complete(json.loads(body), writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self._handlers.discard(task)

    async def _complete(self, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        number = len(self.bodies)
        self.bodies.append(body)
        if number in self.fail:
            await _respond(writer, self.fail[number], {"error": {"message": "busy"}})
            return
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self._stream(number, writer)
        finally:
            self.in_flight -= 1

    async def _stream(self, number: int, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        events: list[str] = [json.dumps(role)]
        for i in range(self.num_chunks):
            if number == self.bad_event_at and i == 2:
                events.append(self.bad_event)
                break
            events.append(json.dumps({"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}))
        if self.include_usage:
            details = None if self.cached_tokens is None else {"cached_tokens": self.cached_tokens}
            usage = {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.num_chunks,
                "total_tokens": self.prompt_tokens + self.num_chunks,
                "prompt_tokens_details": details,
            }
            events.append(json.dumps({"choices": [], "usage": usage}))
        _write_chunk(writer, b": ping\r\n\r\n")
        for event in events:
            _write_chunk(writer, f"data: {event}\n\n".encode())
            await writer.drain()
            await asyncio.sleep(self.delay_s)
        _write_chunk(writer, b"data: [DONE]\n\n")
        _write_chunk(writer, b"")
        await writer.drain()


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str | None, bytes] | None:
    """(path, Authorization header, body) of the next request; None at the end."""
    request_line = await reader.readline()
    if not request_line:
        return None
    path = request_line.decode().split(" ")[1]
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return path, headers.get("authorization"), body


async def _respond(writer: asyncio.StreamWriter, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    head = f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(data)}"
    writer.write(head.encode() + b"\r\n\r\n" + data)
    await writer.drain()


def _write_chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


@contextmanager
def serving(server: FakeServer) -> Iterator[FakeServer]:
    """Run `server` on 127.0.0.1 in a thread of its own; stop it (and its loop) on exit."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _target(server: FakeServer, max_duration_s: float = 30.0) -> bs.Target:
    return bs.Target(server.base_url, bs._headers(None), 10.0, max_duration_s)


def _run(
    server: FakeServer,
    requests: list[WorkloadRequest],
    load: bs.LoadSpec,
    max_duration_s: float = 30.0,
    extra: dict[str, Any] | None = None,
) -> tuple[list[bs.RequestRecord], float]:
    bodies = bs.request_bodies(requests, "fake-model", 5, 0.0, extra or {})
    return asyncio.run(bs.run_step(_target(server, max_duration_s), requests, bodies, load))


def _intent(num: int, seed: int = 0) -> list[WorkloadRequest]:
    return build_workload("intent", num, seed, SYSTEM)


# ---------------------------------------------------------------- statistics


def test_percentile_interpolates_linearly_between_ranks() -> None:
    values = [float(v) for v in range(1, 102)]
    random.Random(0).shuffle(values)
    assert [bs.percentile(values, q) for q in (0, 50, 95, 99, 100)] == [1, 51, 96, 100, 101]
    assert bs.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert bs.percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)
    assert bs.percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert bs.percentile([7.0], 99) == 7.0
    assert bs.percentile([], 50) is None


def _record(index: int, **kwargs: Any) -> bs.RequestRecord:
    return bs.RequestRecord(index, index, 0, **kwargs)


def test_summarize_synthetic_records() -> None:
    records = [
        _record(0, status="ok", submitted_s=0.0, ttft_s=0.1, e2e_s=0.5, output_tokens=5,
                itl_s=[0.1, 0.1, 0.1, 0.1], prompt_tokens=100, cached_tokens=90),
        _record(1, status="ok", submitted_s=0.5, ttft_s=0.3, e2e_s=1.1, output_tokens=3,
                itl_s=[0.4, 0.4], prompt_tokens=100, cached_tokens=0),
        _record(2, status="ok", submitted_s=1.0, ttft_s=0.2, e2e_s=0.2, output_tokens=1),
        _record(3, status="error", submitted_s=1.5, error="HTTP 500: boom"),
        _record(4, status="cancelled", submitted_s=2.0),
        _record(5),
    ]  # fmt: skip
    s = bs.summarize(records, duration_s=3.0)
    assert (s["num_requests"], s["num_completed"], s["num_errors"]) == (6, 3, 1)
    assert (s["num_cancelled"], s["num_not_sent"]) == (1, 1)
    assert s["achieved_qps"] == pytest.approx(4 / 2.0)  # 5 submissions over 2 s
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["total_output_tokens"] == 9
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["cached_tokens_mean"] == 45
    assert s["prompt_tokens_mean"] == 100
    assert s["ttft_ms"]["p50"] == pytest.approx(200)
    assert s["ttft_ms"]["mean"] == pytest.approx(200)
    # TPOT: (0.5 - 0.1) / 4 = 0.1 and (1.1 - 0.3) / 2 = 0.4; one output token has none.
    assert s["tpot_ms"]["p50"] == pytest.approx(250)
    assert s["tpot_ms"]["p95"] == pytest.approx(100 + 300 * 0.95)
    assert s["itl_ms"]["p50"] == pytest.approx(100)  # 4 gaps of 0.1 s, 2 of 0.4 s
    assert s["itl_ms"]["p99"] == pytest.approx(400)
    assert s["e2e_ms"]["p95"] == pytest.approx(500 + 600 * 0.9)  # 200, 500, 1100 ms
    assert s["first_errors"] == ["HTTP 500: boom"]


def test_cached_share_counts_turns_after_the_first() -> None:
    def turn(index: int, number: int, prompt: int, cached: int) -> bs.RequestRecord:
        return bs.RequestRecord(index, 0, number, status="ok", submitted_s=0.0, ttft_s=0.1,
                                e2e_s=0.2, output_tokens=1, prompt_tokens=prompt,
                                cached_tokens=cached)  # fmt: skip

    records = [turn(0, 0, 1000, 900), turn(1, 1, 1200, 1000), turn(2, 2, 1400, 1300)]
    s = bs.summarize(records, duration_s=1.0)
    assert s["cached_share_later_turns"] == pytest.approx(2300 / 2600)  # turn 0 left out
    assert bs.summarize(records[:1], duration_s=1.0)["cached_share_later_turns"] is None


def test_summarize_without_completions_has_no_figures() -> None:
    s = bs.summarize([_record(0, status="error", submitted_s=0.0, error="x")], duration_s=1.0)
    assert s["ttft_ms"] == {"mean": None, "p50": None, "p95": None, "p99": None}
    assert s["achieved_qps"] is None
    assert s["cached_tokens_mean"] is None


def _step(qps: float, e2e_p95_ms: float, num_errors: int = 0, completed: int = 10) -> Any:
    summary = {
        "num_requests": 10,
        "num_completed": completed,
        "num_errors": num_errors,
        "e2e_ms": {"p95": e2e_p95_ms},
    }
    return {"qps": qps, "summary": summary}


def test_sweep_picks_the_highest_qps_meeting_the_slo() -> None:
    steps = [
        _step(0.5, 900),
        _step(1, 1500),
        _step(2, 2000),  # exactly at the SLO: meets it
        _step(3, 1900, num_errors=1),
        _step(4, 1800, num_errors=0, completed=9),  # cut by the duration cap
        _step(8, 9000),
    ]
    assert bs.best_qps(steps, 2.0) == 2
    assert bs.best_qps(steps, 1.0) == 0.5
    assert bs.best_qps(steps, 0.5) is None
    assert bs.best_qps([_step(1, 100), _step(2, 5000), _step(4, 100)], 2.0) == 4


# ---------------------------------------------------------------- arrivals


def test_fixed_arrivals_are_evenly_spaced() -> None:
    assert bs.arrival_offsets(5, 4.0, "fixed", seed=123) == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_poisson_arrivals_follow_the_seeded_exponential_gaps() -> None:
    rng = random.Random(7)
    expected = [0.0]
    for _ in range(9):
        expected.append(expected[-1] + rng.expovariate(2.0))
    assert bs.arrival_offsets(10, 2.0, "poisson", seed=7) == expected
    assert bs.arrival_offsets(10, 2.0, "poisson", seed=8) != expected
    many = bs.arrival_offsets(20_001, 2.0, "poisson", seed=0)
    assert many[-1] / 20_000 == pytest.approx(0.5, rel=0.03)


class FakeClock:
    """A clock whose sleep always oversleeps by `lag` seconds."""

    def __init__(self, lag: float) -> None:
        self.now, self.lag = 100.0, lag
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        self.now += delay + self.lag


def _dispatch(schedule: str, offsets: list[float], lag: float) -> tuple[list[Any], list[float]]:
    clock, planned, actual = FakeClock(lag), [], []

    def submit(i: int, offset: float) -> None:
        planned.append((i, offset))
        actual.append(clock.now - 100.0)

    asyncio.run(bs.dispatch(offsets, schedule, submit, clock, clock.sleep))
    return planned, actual


@pytest.mark.parametrize("arrival", ["fixed", "poisson"])
def test_absolute_schedule_submits_at_the_planned_offsets(arrival: str) -> None:
    offsets = bs.arrival_offsets(20, 5.0, arrival, seed=3)
    planned, actual = _dispatch("absolute", offsets, lag=0.0)
    assert planned == list(enumerate(offsets))
    assert actual == pytest.approx(offsets)


def test_absolute_schedule_catches_up_after_late_wakeups() -> None:
    offsets = [0.0, 1.0, 2.0, 3.0]
    planned, actual = _dispatch("absolute", offsets, lag=0.25)
    assert planned == list(enumerate(offsets))
    assert actual == pytest.approx([0.0, 1.25, 2.25, 3.25])  # late by one lag, never more


def test_relative_schedule_accumulates_lateness() -> None:
    planned, actual = _dispatch("relative", [0.0, 1.0, 2.0, 3.0], lag=0.25)
    assert [p for _, p in planned] == pytest.approx([0.0, 1.0, 2.25, 3.5])
    assert actual == pytest.approx([0.0, 1.25, 2.5, 3.75])


# ---------------------------------------------------------------- runs against the fake server


def test_fixed_concurrency_records_tokens_cached_tokens_and_errors() -> None:
    with serving(FakeServer(num_chunks=5, cached_tokens=7, fail={1: 429, 4: 500})) as server:
        records, duration = _run(
            server, _intent(12), bs.LoadSpec(concurrency=3), extra={"cache_prompt": False}
        )
    assert [r.status for r in records].count("ok") == 10
    errors = sorted(r.error or "" for r in records if r.status == "error")
    assert [e[:8] for e in errors] == ["HTTP 429", "HTTP 500"]
    assert '"busy"' in errors[0]
    ok = [r for r in records if r.status == "ok"]
    assert {(r.output_tokens, r.cached_tokens, r.prompt_tokens, len(r.itl_s)) for r in ok} == {
        (5, 7, 11, 4)
    }
    assert all(r.ttft_s is not None and r.e2e_s is not None and r.ttft_s <= r.e2e_s for r in ok)
    assert server.max_in_flight == 3
    assert len(server.bodies) == 12
    body = server.bodies[0]
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["response_format"] == {"type": "text"}
    assert (body["model"], body["max_tokens"], body["temperature"]) == ("fake-model", 5, 0.0)
    assert body["cache_prompt"] is False
    summary = bs.summarize(records, duration)
    assert (summary["num_completed"], summary["num_errors"]) == (10, 2)
    assert (summary["total_output_tokens"], summary["cached_tokens_mean"]) == (50, 7)


def test_without_usage_counts_content_chunks_and_reports_no_cached_tokens() -> None:
    with serving(FakeServer(num_chunks=4, include_usage=False)) as server:
        records, _ = _run(server, _intent(3), bs.LoadSpec(concurrency=1))
    assert [(r.status, r.output_tokens, r.cached_tokens) for r in records] == [("ok", 4, None)] * 3


def test_server_without_cached_tokens_details_gives_none() -> None:
    with serving(FakeServer(cached_tokens=None)) as server:
        records, _ = _run(server, _intent(2), bs.LoadSpec(concurrency=2))
    assert [(r.status, r.prompt_tokens, r.cached_tokens) for r in records] == [("ok", 11, None)] * 2


@pytest.mark.parametrize(
    ("bad_event", "error"),
    [
        (FakeServer.bad_event, 'stream error: {"error": {"message": "engine failed"'),
        ("not json", "JSONDecodeError: Expecting value"),
        ("[1, 2]", "AttributeError: 'list' object has no attribute 'get'"),
    ],
)
def test_a_bad_event_inside_the_stream_fails_only_its_request(bad_event: str, error: str) -> None:
    with serving(FakeServer(bad_event_at=1, bad_event=bad_event)) as server:
        records, _ = _run(server, _intent(3), bs.LoadSpec(concurrency=1))
    assert [r.status for r in records] == ["ok", "error", "ok"]
    assert records[1].error is not None and records[1].error.startswith(error)


def test_qps_run_schedules_every_request_at_its_offset() -> None:
    load = bs.LoadSpec(qps=200.0, arrival="fixed", submit_schedule="absolute")
    with serving(FakeServer(num_chunks=2)) as server:
        records, duration = _run(server, _intent(8), load)
    assert [r.scheduled_s for r in records] == bs.arrival_offsets(8, 200.0, "fixed", 0)
    assert [r.status for r in records] == ["ok"] * 8
    summary = bs.summarize(records, duration)
    assert summary["achieved_qps"] is not None
    assert summary["num_completed"] == 8


def test_multi_turn_sends_each_turn_after_the_previous_one_finished() -> None:
    requests = build_workload("chat-multi-turn", 9, 0, SYSTEM, num_turns=3)
    with serving(FakeServer(num_chunks=3)) as server:
        records, _ = _run(server, requests, bs.LoadSpec(qps=500.0, arrival="fixed"))
    assert [r.status for r in records] == ["ok"] * 9
    for request, record in zip(requests, records, strict=True):
        if request.depends_on is not None:
            previous = records[request.depends_on]
            assert previous.submitted_s is not None and previous.e2e_s is not None
            assert record.submitted_s is not None
            assert record.submitted_s >= previous.submitted_s + previous.e2e_s
    # The server saw each conversation's turns in order: 1, then 3, then 5 messages + system.
    lengths = [len(b["messages"]) for b in server.bodies]
    for conversation in range(3):
        sent = [len(b["messages"]) for b in server.bodies if _is_conversation(b, conversation)]
        assert sent == [2, 4, 6]
    assert sorted(lengths) == [2] * 3 + [4] * 3 + [6] * 3


def _is_conversation(body: dict[str, Any], conversation: int) -> bool:
    first_user: str = body["messages"][1]["content"]
    requests = build_workload("chat-multi-turn", 9, 0, SYSTEM, num_turns=3)
    return first_user == requests[conversation].messages[1]["content"]


def test_duration_cap_stops_the_run_and_cancels_in_flight_requests() -> None:
    slow = FakeServer(num_chunks=400, delay_s=0.02)  # 8 s a request, far past the cap
    with serving(slow) as server:
        records, _ = _run(server, _intent(6), bs.LoadSpec(concurrency=2), max_duration_s=0.3)
    assert [r.status for r in records].count("cancelled") == 2
    assert [r.status for r in records].count("not_sent") == 4
    summary = bs.summarize(records, 0.3)
    assert (summary["num_completed"], summary["num_cancelled"]) == (0, 2)


def test_duration_cap_stops_submitting_arrivals() -> None:
    load = bs.LoadSpec(qps=1.0, arrival="fixed")  # the second request is due after the cap
    with serving(FakeServer(num_chunks=2)) as server:
        records, _ = _run(server, _intent(5), load, max_duration_s=0.3)
    assert [r.status for r in records] == ["ok"] + ["not_sent"] * 4


# ---------------------------------------------------------------- the CLI and its JSON


def test_main_writes_a_json_report_with_its_header(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    with serving(FakeServer(num_chunks=3, cached_tokens=5)) as server:
        argv = [
            "--base-url", server.base_url, "--label", "fake", "--num-requests", "6",
            "--concurrency", "2", "--warmup", "2", "--ignore-eos", "--out", str(out),
            "--api-key", "sk-secret",
        ]  # fmt: skip
        assert bs.main(argv) == 0
        assert set(server.authorizations) == {"Bearer sk-secret"}  # /models included
        assert len(server.bodies) == 8  # 2 warmup + 6 measured
        assert all(b["ignore_eos"] is True for b in server.bodies)
        assert {b["max_tokens"] for b in server.bodies} == {DEFAULT_MAX_TOKENS["intent"]}
    report = json.loads(out.read_text())
    assert report["schema"] == bs.SCHEMA
    assert report["command"].startswith("tools/bench_serving.py --base-url http://127.0.0.1:")
    assert report["git_revision"] == bs.git_revision()
    assert (report["label"], report["model"], report["workload"]) == (
        "fake",
        "fake-model",
        "intent",
    )
    assert report["base_url"] == server.base_url
    assert report["date"]
    assert report["settings"]["concurrency"] == 2
    assert report["sweep"] is None
    [step] = report["steps"]
    assert (step["qps"], step["concurrency"]) == (None, 2)
    assert step["summary"]["num_completed"] == 6
    assert step["summary"]["cached_tokens_mean"] == 5
    assert len(step["requests"]) == 6
    assert set(step["requests"][0]) >= {"ttft_s", "e2e_s", "itl_s", "tpot_s", "cached_tokens"}
    stdout = capsys.readouterr().out
    assert "sk-secret" not in stdout + out.read_text()
    assert report["settings"]["api_key"] == "<redacted>"
    assert stdout.startswith("# tools/bench_serving.py --base-url")
    assert "| concurrency 2 | 6 | 6 | 0 | 0 |" in stdout


def test_main_sweep_reports_each_step_and_the_best_qps(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    with serving(FakeServer(num_chunks=2)) as server:
        argv = [
            "--base-url", server.base_url, "--model", "m", "--num-requests", "4",
            "--sweep-qps", "100,200", "--arrival", "fixed", "--slo-latency", "30",
            "--out", str(out),
        ]  # fmt: skip
        assert bs.main(argv) == 0
        users = [b["messages"][1]["content"] for b in server.bodies]
    report = json.loads(out.read_text())
    assert [s["qps"] for s in report["steps"]] == [100, 200]
    assert report["sweep"] == {"slo_latency_s": 30, "best_qps": 200}
    assert report["label"] == "m"
    # Each step sends fresh messages: no prompt of step 1 repeats one of step 0.
    assert len(users) == 8
    assert not set(users[:4]) & set(users[4:])


def test_main_without_a_server_fails_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    with serving(FakeServer()) as server:
        url = server.base_url
    assert bs.main(["--base-url", url, "--request-timeout", "2"]) == 2
    assert "pass --model" in capsys.readouterr().err


def test_load_options_are_exclusive_and_validated(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--qps", "1", "--concurrency", "2"], ["--qps", "0"], ["--extra-body", "[1]"]):
        with pytest.raises(SystemExit):
            bs.parse_args(argv)
    capsys.readouterr()
    args = bs.parse_args(["--workload", "decode-heavy", "--sweep-qps", "0.5,1,2"])
    assert (args.max_tokens, args.ignore_eos, args.sweep_qps) == (128, True, [0.5, 1.0, 2.0])
    assert bs.parse_args(["--workload", "decode-heavy", "--no-ignore-eos"]).ignore_eos is False
    assert bs.parse_args([]).ignore_eos is False


def test_help_explains_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bs.parse_args(["--help"])
    text = capsys.readouterr().out
    for option in ("--submit-schedule", "--sweep-qps", "--max-duration", "--extra-body"):
        assert option in text


# ---------------------------------------------------------------- workloads


@pytest.mark.parametrize("name", ["intent", "unique", "chat-multi-turn", "decode-heavy", "copy"])
def test_workloads_are_deterministic(name: str) -> None:
    def build(seed: int, stream: int | str = 0) -> list[WorkloadRequest]:
        return build_workload(name, 10, seed, SYSTEM, num_turns=3, stream=stream)

    assert build(1) == build(1)
    assert build(1) != build(2)
    assert build(1) != build(1, stream=1)
    assert len(build(1)) == 10


def test_intent_matches_intent_messages_and_sizes_the_user_turn() -> None:
    tokenizer = ApproxTokenizer()
    requests = build_workload("intent", 20, 5, SYSTEM, tokenizer)
    assert [r.messages for r in requests] == intent_messages(SYSTEM[0]["content"], tokenizer, 20, 5)
    # customer_message stops before a sentence would pass its target (50-100 tokens), so
    # messages run from ~35 to 100 tokens, ~65 on average.
    sizes = [len(tokenizer.encode(r.messages[1]["content"])) for r in requests]
    assert 30 <= min(sizes) <= max(sizes) <= 100
    assert 55 <= sum(sizes) / len(sizes) <= 80
    assert customer_message(random.Random(1), None) == customer_message(random.Random(1), tokenizer)


def _render(messages: list[dict[str, str]]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def test_unique_prompts_share_nothing_beyond_the_template_start() -> None:
    intent = build_workload("intent", 64, 0, SYSTEM)
    unique = build_workload("unique", 64, 0, SYSTEM)
    template_start = len("<|im_start|>system\n")
    prompts = [_render(r.messages) for r in unique]
    longest = max(_common_prefix(a, b) for i, a in enumerate(prompts) for b in prompts[i + 1 :])
    assert template_start <= longest < template_start + 16  # never the whole 16-digit nonce
    for u, i in zip(unique, intent, strict=True):
        assert u.messages[1] == i.messages[1]
        assert u.messages[0]["content"].endswith("\n" + SYSTEM[0]["content"])
        assert not u.messages[0]["content"].startswith(SYSTEM[0]["content"][:1])


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_multi_turn_conversations_grow_with_canned_replies() -> None:
    requests = build_workload("chat-multi-turn", 7, 0, SYSTEM, num_turns=3)
    assert [(r.conversation, r.turn, r.depends_on) for r in requests] == [
        (0, 0, None), (1, 0, None), (2, 0, None),
        (0, 1, 0), (1, 1, 1), (2, 1, 2),
        (0, 2, 3),
    ]  # fmt: skip
    for r in requests:
        assert r.messages[0] == SYSTEM[0]
        assert [m["role"] for m in r.messages[1:]] == ["user", "assistant"] * r.turn + ["user"]
        if r.depends_on is not None:
            before = requests[r.depends_on].messages
            assert r.messages[: len(before)] == before
    again = build_workload("chat-multi-turn", 7, 9, SYSTEM, num_turns=3)
    assert requests[3].messages[2] == again[3].messages[2]  # the replies are canned


def test_decode_heavy_prompts_are_short_and_have_no_system_prompt() -> None:
    tokenizer = ApproxTokenizer()
    for r in build_workload("decode-heavy", 20, 0, SYSTEM):
        [message] = r.messages
        assert message["role"] == "user"
        assert 12 <= len(tokenizer.encode(message["content"])) <= 28


def test_copy_requests_follow_the_whole_entry_and_differ_from_each_other() -> None:
    entry = [*SYSTEM, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    requests = build_workload("copy", 50, 0, entry)
    for r in requests:
        assert r.messages[:-1] == entry
        assert r.messages[-1]["role"] == "user"
        assert re.search(r"(Quote|Copy|Repeat|quote|Rewrite|Extract)", r.messages[-1]["content"])
    assert len({r.messages[-1]["content"] for r in requests}) == 50


def test_the_shipped_prefixes_feed_the_workloads() -> None:
    args = bs.parse_args(["--prefixes", str(REPO / "prefixes.yaml")])
    [system] = bs._prefix_messages(args)
    assert system["role"] == "system"
    assert system["content"].startswith("You are the intent classifier for Acme Cloud Storage")
    chat = bs._prefix_messages(bs.parse_args(["--workload", "chat-multi-turn"]))
    assert [m["role"] for m in chat] == ["system", "user", "assistant", "user", "assistant"]
    assert bs._prefix_messages(bs.parse_args(["--workload", "copy"])) == chat
    assert bs._prefix_messages(bs.parse_args(["--workload", "decode-heavy"])) == []
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("nope", 1, 0, SYSTEM)


def test_step_duration_sizes_rate_steps_but_not_concurrency_steps() -> None:
    args = argparse.Namespace(num_requests=40, step_duration=60.0)
    assert bs.step_size(args, bs.LoadSpec(qps=0.1)) == 10  # 6 due, at least 10
    assert bs.step_size(args, bs.LoadSpec(qps=0.5)) == 30
    assert bs.step_size(args, bs.LoadSpec(qps=4.0)) == 40  # capped by --num-requests
    assert bs.step_size(args, bs.LoadSpec(concurrency=8)) == 40
    assert (
        bs.step_size(argparse.Namespace(num_requests=7, step_duration=None), bs.LoadSpec(qps=9.0))
        == 7
    )
