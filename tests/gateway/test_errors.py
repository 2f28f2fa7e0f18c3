"""gateway.errors: every failure leaves as OpenAI's error JSON with the right status."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from engine import (
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    ModelLoadError,
    PrefixBudgetError,
    PromptTooLongError,
    RegistryFileError,
    RequestFailedError,
)
from gateway.admission import parse_model
from gateway.errors import (
    INTERNAL_ERROR_MESSAGE,
    OpenAIError,
    forbidden,
    from_engine_error,
    install_error_handlers,
    not_ready,
    too_many_requests,
    unauthorized,
    unknown_model,
)
from gateway.protocol import ChatCompletionRequest


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


ENGINE_ERRORS: list[tuple[str, EngineError, int, dict[str, Any]]] = [
    (
        "invalid-request",
        InvalidRequestError("top_p must be in (0, 1]", param="top_p"),
        400,
        error_body("top_p must be in (0, 1]", "invalid_request_error", "top_p"),
    ),
    (
        "invalid-request-no-param",
        InvalidRequestError("the chat template rejected the messages"),
        400,
        error_body("the chat template rejected the messages", "invalid_request_error"),
    ),
    (
        "prompt-too-long",
        PromptTooLongError("too long: 9000 tokens > 2048", 9000, 2048),
        400,
        error_body(
            "too long: 9000 tokens > 2048",
            "invalid_request_error",
            "prompt",
            "context_length_exceeded",
        ),
    ),
    (
        "registry-file",
        RegistryFileError(Path("prefixes.yaml"), ["entry 0: no name", "entry 1: no text"]),
        400,
        error_body(
            "prefixes.yaml: entry 0: no name; entry 1: no text",
            "invalid_request_error",
            code="invalid_prefix_file",
        ),
    ),
    (
        "prefix-budget",
        PrefixBudgetError("prefixes would pin 90% of the KV pool"),
        400,
        error_body(
            "prefixes would pin 90% of the KV pool",
            "invalid_request_error",
            code="prefix_budget_exceeded",
        ),
    ),
    (
        "engine-dead",
        EngineDeadError("the engine loop has stopped: CUDA error: out of memory"),
        503,
        error_body(
            "The inference engine has stopped; this server cannot serve requests.",
            "server_error",
            code="engine_unavailable",
        ),
    ),
    (
        "request-failed",
        RequestFailedError("could not add the request: KeyError('secret')"),
        500,
        error_body(INTERNAL_ERROR_MESSAGE, "server_error"),
    ),
    (
        "model-load",
        ModelLoadError("model path /models/x does not exist"),
        500,
        error_body(
            "The model could not be loaded: model path /models/x does not exist",
            "server_error",
            code="model_load_failed",
        ),
    ),
    (
        "engine-error",
        EngineError("internal detail"),
        500,
        error_body(INTERNAL_ERROR_MESSAGE, "server_error"),
    ),
]


@pytest.mark.parametrize(
    ("exc", "status", "body"),
    [pytest.param(exc, status, body, id=name) for name, exc, status, body in ENGINE_ERRORS],
)
def test_from_engine_error(exc: EngineError, status: int, body: dict[str, Any]) -> None:
    error = from_engine_error(exc)
    assert error.status_code == status
    assert error.body() == body


def test_server_side_engine_errors_are_logged_with_their_detail(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR, logger="gateway.errors"):
        from_engine_error(RequestFailedError("forward raised"))
        from_engine_error(InvalidRequestError("bad"))
    assert [r.getMessage() for r in caplog.records] == ["RequestFailedError: forward raised"]


# -- through an app --------------------------------------------------------------------------

RAISED: dict[str, Exception] = {
    "engine-dead": EngineDeadError("stopped"),
    "too-long": PromptTooLongError("too long", 10, 5),
    "openai": unknown_model("gpt-9"),
    "busy": too_many_requests(2.5),
    "http-400": HTTPException(400, "bad header"),
    "http-502": HTTPException(502, "upstream"),
    "unexpected": RuntimeError("secret internal state"),
}


async def _raise(request: Request) -> Response:
    kind = request.path_params["kind"]
    if kind == "validation":
        ChatCompletionRequest.model_validate({"model": "m"})
    raise RAISED[kind]


async def _chat(request: Request) -> JSONResponse:
    body = parse_model(await request.body(), ChatCompletionRequest)
    return JSONResponse({"model": body.model})


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    app = Starlette(
        routes=[
            Route("/raise/{kind}", _raise, methods=["GET"]),
            Route("/v1/chat/completions", _chat, methods=["POST"]),
        ]
    )
    install_error_handlers(app)
    # Starlette re-raises unhandled errors after the 500 is sent (so servers log them too).
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.mark.parametrize(
    ("kind", "status", "body"),
    [
        (
            "engine-dead",
            503,
            error_body(
                "The inference engine has stopped; this server cannot serve requests.",
                "server_error",
                code="engine_unavailable",
            ),
        ),
        (
            "too-long",
            400,
            error_body("too long", "invalid_request_error", "prompt", "context_length_exceeded"),
        ),
        (
            "openai",
            404,
            error_body(
                "The model `gpt-9` does not exist or you do not have access to it.",
                "invalid_request_error",
                "model",
                "model_not_found",
            ),
        ),
        (
            "validation",
            400,
            error_body(
                "Missing required parameter: 'messages'.",
                "invalid_request_error",
                "messages",
                "missing_required_parameter",
            ),
        ),
        ("http-400", 400, error_body("bad header", "invalid_request_error")),
        ("http-502", 502, error_body("upstream", "server_error")),
    ],
)
def test_handlers_shape_raised_errors(
    client: TestClient, kind: str, status: int, body: dict[str, Any]
) -> None:
    response = client.get(f"/raise/{kind}")
    assert response.status_code == status
    assert response.json() == body


def test_unexpected_error_is_a_generic_500_logged_with_traceback(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="gateway.errors"):
        response = client.get("/raise/unexpected")
    assert response.status_code == 500
    assert response.json() == error_body(INTERNAL_ERROR_MESSAGE, "server_error")
    assert "secret" not in response.text
    (record,) = [r for r in caplog.records if r.name == "gateway.errors"]
    assert record.getMessage() == "unhandled error on GET /raise/unexpected"
    assert record.exc_info is not None and isinstance(record.exc_info[1], RuntimeError)


def test_unknown_route_is_an_openai_404(client: TestClient) -> None:
    response = client.post("/v1/chat/completionz", json={})
    assert response.status_code == 404
    assert response.json() == error_body(
        "Invalid URL (POST /v1/chat/completionz)", "invalid_request_error"
    )


def test_wrong_method_is_an_openai_405(client: TestClient) -> None:
    response = client.get("/v1/chat/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json() == error_body(
        "Method GET is not allowed for /v1/chat/completions.",
        "invalid_request_error",
        code="method_not_allowed",
    )


def _invalid_json(detail: str) -> dict[str, Any]:
    message = (
        f"We could not parse the JSON body of your request ({detail}). "
        "The API expects a JSON object with the request's parameters."
    )
    return error_body(message, "invalid_request_error", code="invalid_json")


@pytest.mark.parametrize(
    ("content", "detail"),
    [
        (b"", "Expecting value: line 1 column 1 (char 0)"),
        (
            b'{"model": "m",',
            "Expecting property name enclosed in double quotes: line 1 column 15 (char 14)",
        ),
        (
            b"\xff{}",
            "the body is not valid UTF-8: 'utf-8' codec can't decode byte 0xff in position 0: "
            "invalid start byte",
        ),
        (b'{"temperature": NaN}', "NaN is not valid JSON"),
        (b"[1, 2]", "expected a JSON object, but got an array"),
        (b'"hello"', "expected a JSON object, but got a string"),
        (b"null", "expected a JSON object, but got null"),
        (b"[" * 100_000, "the JSON is nested too deeply"),
    ],
    ids=["empty", "truncated", "not-utf8", "nan", "array", "string", "null", "too-deep"],
)
def test_invalid_json(client: TestClient, content: bytes, detail: str) -> None:
    response = client.post("/v1/chat/completions", content=content)
    assert response.status_code == 400
    assert response.json() == _invalid_json(detail)


def test_valid_body_reaches_the_route(client: TestClient) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.json() == {"model": "m"}


@pytest.mark.parametrize(("retry_after", "header"), [(0.0, "1"), (0.2, "1"), (2.5, "3"), (7, "7")])
def test_too_many_requests_carries_retry_after(retry_after: float, header: str) -> None:
    response = too_many_requests(retry_after).response()
    assert response.status_code == 429
    assert response.headers["retry-after"] == header


def test_429_through_the_app(client: TestClient) -> None:
    response = client.get("/raise/busy")
    assert response.status_code == 429
    assert response.headers["retry-after"] == "3"
    assert response.json() == error_body(
        "Too many requests are waiting to start on this server (--max-waiting). Retry after 3 s.",
        "requests",
        code="rate_limit_exceeded",
    )


@pytest.mark.parametrize(
    ("error", "status", "headers", "body"),
    [
        (
            unauthorized(),
            401,
            {"www-authenticate": "Bearer"},
            error_body(
                "Incorrect API key provided. Send the server's API key as "
                "'Authorization: Bearer <key>'.",
                "invalid_request_error",
                code="invalid_api_key",
            ),
        ),
        (
            forbidden(),
            403,
            {},
            error_body(
                "This API key is not allowed to use the admin endpoints.",
                "permission_error",
                code="insufficient_permissions",
            ),
        ),
        (
            not_ready(),
            503,
            {"retry-after": "1"},
            error_body(
                "The server is not ready: it is still loading the model and its prefixes.",
                "server_error",
                code="not_ready",
            ),
        ),
        (
            not_ready("the model failed to load"),
            503,
            {"retry-after": "1"},
            error_body(
                "The server is not ready: the model failed to load",
                "server_error",
                code="not_ready",
            ),
        ),
        (
            OpenAIError(418, "teapot", "invalid_request_error", "x", "teapot"),
            418,
            {},
            error_body("teapot", "invalid_request_error", "x", "teapot"),
        ),
    ],
    ids=["401", "403", "503", "503-detail", "custom"],
)
def test_gateway_errors(
    error: OpenAIError, status: int, headers: dict[str, str], body: dict[str, Any]
) -> None:
    response = error.response()
    assert response.status_code == status
    assert bytes(response.body) == JSONResponse(body).body
    for name, value in headers.items():
        assert response.headers[name] == value
