"""Admission under hostile and careless clients, in-process on the tiny Llama: body limits,
content types, slow and vanishing uploads, text validity, the waiting-queue limit, abort of
non-streaming requests whose client left, the chat default length, auth, CORS, the drain.

Requests that must observe the server while it holds them (a paused engine, a client that
leaves mid-upload) are driven through the raw ASGI interface (`AsgiCall`), whose `receive`
is scripted; finite ones use Starlette's TestClient.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.testclient import TestClient

from engine import AsyncEngine, EngineConfig, LLMEngine
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.state import Gateway

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
CHAT = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "The quick brown fox", "temperature": 0, "max_tokens": 4}
LONG = {"max_tokens": 200, "ignore_eos": True}
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def engine_config(tiny_llama_path: Path) -> EngineConfig:
    return EngineConfig(
        model=str(tiny_llama_path),
        block_size=4,
        num_kv_blocks=512,
        max_model_len=256,
        max_num_seqs=4,
        debug_check_integrity=True,
    )


def _app(engine_config: EngineConfig, **settings: Any) -> Starlette:
    engine = AsyncEngine(engine_config, engine=LLMEngine(engine_config))
    return create_app(GatewayConfig(engine=engine_config, **settings), engine=engine)


def _gateway(app: Starlette) -> Gateway:
    gateway: Gateway = app.state.gateway
    return gateway


def _assert_idle(app: Starlette) -> None:
    """No request left anywhere, every block free, ref counts equal holders."""
    gateway = _gateway(app)
    engine = gateway.engine
    assert engine is not None
    asyncio.run(engine.run_in_engine(lambda e: e.check_integrity()))
    stats = engine.stats()
    assert (stats.num_requests_running, stats.num_requests_waiting) == (0, 0)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    assert (gateway.num_waiting, len(gateway.tickets)) == (0, 0)


@pytest.fixture(scope="module")
def app(engine_config: EngineConfig) -> Starlette:
    return _app(engine_config, max_request_bytes=4096, max_waiting=8, max_prompts=4)


@pytest.fixture(scope="module")
def module_client(app: Starlette) -> Iterator[TestClient]:
    with TestClient(app) as client:  # the lifespan stops the engine at the end
        yield client


@pytest.fixture
def client(module_client: TestClient, app: Starlette) -> Iterator[TestClient]:
    yield module_client
    _assert_idle(app)


def _error(response: Any) -> tuple[int, str | None, str | None]:
    error = response.json()["error"]
    return response.status_code, error["code"], error["param"]


# -- a raw ASGI call with a scripted client ----------------------------------------------------


@dataclass
class AsgiCall:
    """One HTTP request driven through the ASGI interface: `chunks` are sent as the body,
    then the client stays (`leave` unset) or disconnects (`leave.set()`); `hang` keeps the
    upload open forever after the chunks; `vanish` disconnects right after them, mid-upload."""

    app: Starlette
    path: str
    chunks: list[bytes]
    headers: list[tuple[bytes, bytes]] = field(
        default_factory=lambda: [(b"content-type", b"application/json")]
    )
    hang: bool = False
    vanish: bool = False
    leave: asyncio.Event = field(default_factory=asyncio.Event)
    status: int | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)
    body: bytearray = field(default_factory=bytearray)

    async def run(self) -> None:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "query_string": b"",
            "headers": self.headers,
            "client": ("127.0.0.1", 1234),
            "server": ("127.0.0.1", 8000),
            "app": self.app,
        }
        await self.app(scope, self._receive(), self._send)

    def _receive(self) -> Any:
        messages = self._messages()

        async def receive() -> dict[str, Any]:
            return await anext(messages)

        return receive

    async def _messages(self) -> AsyncIterator[dict[str, Any]]:
        for i, chunk in enumerate(self.chunks):
            more = self.hang or self.vanish or i < len(self.chunks) - 1
            yield {"type": "http.request", "body": chunk, "more_body": more}
        if self.hang:
            await asyncio.sleep(3600)
        if not self.vanish:
            await self.leave.wait()
        while True:
            yield {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.started.set()
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")

    def events(self) -> list[str]:
        return [
            line.removeprefix("data: ")
            for line in self.body.decode().splitlines()
            if line.startswith("data: ")
        ]


def _json(body: dict[str, Any]) -> list[bytes]:
    return [json.dumps(body).encode()]


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


# -- body limits and content types -------------------------------------------------------------


def test_a_body_over_the_limit_is_413_declared_or_chunked(client: TestClient) -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    declared = client.post("/v1/chat/completions", json=big)
    chunked = client.post(
        "/v1/chat/completions",
        content=iter([json.dumps(big).encode()[:3000], json.dumps(big).encode()[3000:]]),
        headers={"content-type": "application/json"},
    )
    for response in (declared, chunked):
        assert _error(response) == (413, "request_too_large", None)
        assert response.json()["error"]["message"] == (
            "The request body is larger than this server accepts (4096 bytes, --max-request-bytes)."
        )


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_body_that_is_not_json_is_415(client: TestClient, content_type: str) -> None:
    response = client.post(
        "/v1/chat/completions", content=json.dumps(CHAT), headers={"content-type": content_type}
    )
    assert _error(response) == (415, "unsupported_media_type", None)


@pytest.mark.parametrize("content_type", [None, "application/json; charset=utf-8"])
def test_json_content_types_and_none_are_accepted(
    client: TestClient, content_type: str | None
) -> None:
    headers = {"content-type": content_type} if content_type else {}
    response = client.post("/v1/completions", content=json.dumps(COMPLETION), headers=headers)
    assert response.status_code == 200, response.text


def test_a_slow_upload_is_408(engine_config: EngineConfig) -> None:
    app = _app(engine_config, request_read_timeout=0.2)
    call = AsgiCall(app, "/v1/chat/completions", [b'{"model": '], hang=True)
    try:
        run(call.run())
    finally:
        _gateway(app).shutdown()
    assert call.status == 408
    assert json.loads(call.body)["error"]["code"] == "request_timeout"


def test_a_client_leaving_mid_upload_is_counted_499_not_500(engine_config: EngineConfig) -> None:
    app = _app(engine_config)
    call = AsgiCall(app, "/v1/chat/completions", [b'{"model": '], vanish=True)
    try:
        run(call.run())
        body, _ = _gateway(app).metrics.render()
    finally:
        _gateway(app).shutdown()
    assert call.status == 499
    assert b'route="/v1/chat/completions",status="499"} 1.0' in body
    assert b'status="500"' not in body


# -- text validity ------------------------------------------------------------------------------

SURROGATE_CASES = [
    (
        "/v1/chat/completions",
        '"messages": [{"role": "user", "content": "a\\ud800b"}]',
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        '"messages": [{"role": "user", "content": "\\udfff"}]',
        "messages[0].content",
    ),
    ("/v1/completions", '"prompt": "\\ud800"', "prompt"),
    ("/v1/completions", '"prompt": ["ok", "x\\udc00"]', "prompt[1]"),
    (
        "/v1/prefixes/match",
        '"messages": [{"role": "user", "content": "\\ud800"}]',
        "messages[0].content",
    ),
    ("/tokenize", '"prompt": "x\\udc00"', "prompt"),
]


@pytest.mark.parametrize(("path", "fields", "param"), SURROGATE_CASES)
def test_lone_surrogates_are_400_naming_the_field(
    client: TestClient, path: str, fields: str, param: str
) -> None:
    raw = f'{{"model": "{MODEL}", "max_tokens": 2, {fields}}}'
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert _error(response) == (400, "invalid_value", param)


def test_a_valid_surrogate_pair_is_text(client: TestClient) -> None:
    raw = f'{{"model": "{MODEL}", "max_tokens": 2, "prompt": "smile \\ud83d\\ude00"}}'
    response = client.post("/v1/completions", content=raw)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/prefixes/match", {"prompt": [1, 10**9]}, "prompt"),
        ("/tokenize", {"prompt": [1, 10**9]}, "prompt"),
        ("/detokenize", {"tokens": [1, 512]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
    ],
)
def test_an_out_of_vocabulary_token_id_is_400(
    client: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    response = client.post(path, json={"model": MODEL, **body})
    assert _error(response) == (400, "invalid_token_id", param)
    assert response.json()["error"]["message"] == "token ids must be in [0, 512)"


# -- the waiting queue --------------------------------------------------------------------------


def test_streaming_bursts_cannot_pass_the_waiting_limit(engine_config: EngineConfig) -> None:
    """12 simultaneous streams against --max-waiting 2 while the engine makes no progress:
    exactly 2 are admitted, 10 get 429 (before the fix, every stream was admitted)."""
    app = _app(engine_config, max_waiting=2)
    engine = _gateway(app).engine
    assert engine is not None
    resume = threading.Event()
    body = _json({**COMPLETION, **LONG, "stream": True})

    async def burst() -> list[int | None]:
        engine._submit(resume.wait)  # the engine thread blocks: nobody gets a token
        calls = [AsgiCall(app, "/v1/completions", body) for _ in range(12)]
        tasks = [asyncio.ensure_future(c.run()) for c in calls]
        await asyncio.wait_for(asyncio.gather(*(c.started.wait() for c in calls)), TIMEOUT_S)
        statuses = [c.status for c in calls]
        for call in calls:
            call.leave.set()
        resume.set()
        await asyncio.gather(*tasks)
        return statuses

    try:
        statuses = run(burst())
        _wait_idle(app)
    finally:
        resume.set()
        _gateway(app).shutdown()
    assert sorted(statuses) == [200] * 2 + [429] * 10  # type: ignore[type-var]


def _wait_idle(app: Starlette) -> None:
    """Aborted requests leave the engine within a few loop turns; then check everything."""
    engine = _gateway(app).engine
    assert engine is not None
    for _ in range(500):
        stats = engine.stats()
        if stats.num_requests_running == stats.num_requests_waiting == 0:
            break
        threading.Event().wait(0.01)
    _assert_idle(app)


@pytest.mark.parametrize(
    ("path", "body", "code", "param"),
    [
        ("/v1/completions", {**COMPLETION, "prompt": ["Hi"] * 5}, "invalid_value", "prompt"),
        (
            "/v1/completions",
            {**COMPLETION, "prompt": ["Hi"] * 4, "n": 3},
            "too_many_sequences",
            "n",
        ),
        ("/v1/chat/completions", {**CHAT, "n": 9}, "too_many_sequences", "n"),
    ],
    ids=["prompt-list-over-max-prompts", "n-x-prompts-over-max-waiting", "n-over-max-waiting"],
)
def test_requests_bigger_than_the_queue_are_refused(
    client: TestClient, path: str, body: dict[str, Any], code: str, param: str
) -> None:
    assert _error(client.post(path, json=body)) == (400, code, param)


# -- clients that leave ------------------------------------------------------------------------


def test_a_non_streaming_request_is_aborted_when_its_client_leaves(
    engine_config: EngineConfig,
) -> None:
    app = _app(engine_config)
    gateway = _gateway(app)
    engine = gateway.engine
    assert engine is not None

    async def leave_after_first_steps() -> AsgiCall:
        call = AsgiCall(app, "/v1/completions", _json({**COMPLETION, **LONG}))
        task = asyncio.ensure_future(call.run())
        while engine.stats().num_requests_running == 0:  # generating now
            await asyncio.sleep(0.01)
        call.leave.set()
        await task
        return call

    try:
        call = run(leave_after_first_steps())
        _wait_idle(app)
        body, _ = gateway.metrics.render()
    finally:
        gateway.shutdown()
    assert call.status == 499
    # Aborted, not generated to its end: a finished request would have been observed.
    assert _sample(body, "prefixgate_e2e_request_latency_seconds_count") == 0.0


def _sample(exposition: bytes, name: str) -> float:
    """The sum of a metric's samples named `name` (0 when it has none)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(exposition.decode())
        for sample in family.samples
        if sample.name == name
    )


def test_chat_without_max_tokens_gets_the_default_length(engine_config: EngineConfig) -> None:
    app = _app(engine_config, default_max_tokens=5)
    body = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "ignore_eos": True}
    try:
        with TestClient(app) as client:
            response = client.post("/v1/chat/completions", json=body)
    finally:
        _gateway(app).shutdown()
    assert response.status_code == 200, response.text
    data = response.json()
    assert (data["usage"]["completion_tokens"], data["choices"][0]["finish_reason"]) == (
        5,
        "length",
    )


# -- auth ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "path", "token", "status"),
    [
        ({"api_keys": ("k",)}, "/v1/prefixes", "k", 200),  # a tenant reads its own view
        ({"api_keys": ("k",)}, "POST /v1/prefixes/reload", "k", 403),  # no admin key
        ({"api_keys": ("k",)}, "/v1/prefixes", None, 401),
        ({"api_keys": ("k",), "admin_api_key": "a"}, "/v1/models", "a", 200),  # admin infers
        ({"api_keys": ("k",), "admin_api_key": "a"}, "/v1/prefixes", "a", 200),
        ({"api_keys": ("k",), "admin_api_key": "a"}, "POST /v1/prefixes/reload", "k", 403),
        ({"api_keys": ("a=k1", "b=k2")}, "/v1/models", "k2", 200),  # every key is a tenant
        ({"api_keys": ("a=k1", "b=k2")}, "/v1/models", "k3", 401),
        ({"admin_api_key": "a"}, "/v1/models", None, 200),  # no api key: inference open
        ({"admin_api_key": "a"}, "/v1/prefixes", None, 401),
        ({}, "/v1/prefixes", None, 200),  # no keys at all: local development
        ({"metrics_api_key": "m"}, "/metrics", None, 401),
        ({"metrics_api_key": "m"}, "/metrics", "m", 200),
        ({"metrics_api_key": "m", "admin_api_key": "a"}, "/metrics", "a", 200),
        ({"api_keys": ("k",)}, "/metrics", None, 200),  # public unless --metrics-api-key
    ],
)
def test_who_may_call_what(
    engine_config: EngineConfig, keys: dict[str, str], path: str, token: str | None, status: int
) -> None:
    app = _app(engine_config, **keys)
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        with TestClient(app) as client:
            method, _, route = path.rpartition(" ")
            response = client.request(method or "GET", route, headers=headers)
    finally:
        _gateway(app).shutdown()
    assert response.status_code == status, response.text


# -- CORS ---------------------------------------------------------------------------------------


def test_cors_preflight_with_allowed_origins(engine_config: EngineConfig) -> None:
    app = _app(engine_config, allowed_origins=("https://app.example",))
    preflight = {
        "origin": "https://app.example",
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    try:
        with TestClient(app) as client:
            allowed = client.options("/v1/chat/completions", headers=preflight)
            other = client.options(
                "/v1/chat/completions", headers={**preflight, "origin": "https://evil.example"}
            )
    finally:
        _gateway(app).shutdown()
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    assert other.status_code == 400


# -- the drain ----------------------------------------------------------------------------------


def test_drain_ends_streams_with_an_error_then_done_and_refuses_new_requests(
    engine_config: EngineConfig,
) -> None:
    app = _app(engine_config)
    gateway = _gateway(app)
    stream_body = _json({**COMPLETION, **LONG, "stream": True})

    async def scenario() -> tuple[AsgiCall, AsgiCall, Any]:
        stream = AsgiCall(app, "/v1/completions", stream_body)
        task = asyncio.ensure_future(stream.run())
        while not stream.events():  # streaming now
            await asyncio.sleep(0.01)
        drain = asyncio.ensure_future(gateway.drain(grace=0.1))
        while not gateway.is_draining:
            await asyncio.sleep(0)
        late = AsgiCall(app, "/v1/completions", _json(COMPLETION))
        late.leave.set()
        await late.run()
        await drain
        await asyncio.wait_for(task, TIMEOUT_S)
        return stream, late, drain

    try:
        stream, late, _ = run(scenario())
    finally:
        gateway.shutdown()
    events = stream.events()
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2]) == {
        "error": {
            "message": "The server is shutting down and no longer accepts requests; retry "
            "elsewhere.",
            "type": "server_error",
            "param": None,
            "code": "server_shutting_down",
        }
    }
    assert late.status == 503
    assert json.loads(late.body)["error"]["code"] == "server_shutting_down"
    assert len(gateway.tickets) == 0
