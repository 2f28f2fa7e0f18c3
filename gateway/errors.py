"""The one place errors become HTTP: every failure leaves the server as OpenAI's error JSON,
`{"error": {"message", "type", "param", "code"}}`, with the status OpenAI would use.

Types follow OpenAI: "invalid_request_error" for 4xx the caller can fix, "server_error" for
5xx, "requests" for 429, "permission_error" for 403. Codes are OpenAI's where one exists
("context_length_exceeded", "model_not_found", "invalid_api_key", "rate_limit_exceeded",
"missing_required_parameter", "invalid_type", "invalid_value", "unsupported_parameter",
"unsupported_value"), else ours ("invalid_json", "engine_unavailable", "not_ready", ...).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import (
    EngineDeadError,
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
    ModelLoadError,
    PrefixBudgetError,
    PromptTooLongError,
    RegistryFileError,
)
from gateway.protocol import ErrorInfo, ErrorResponse, json_type_name

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=BaseModel)

INTERNAL_ERROR_MESSAGE = "The server had an error while processing your request."


class OpenAIError(Exception):
    """An error on its way to the client; raise it anywhere under a route."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body, also what a stream sends as its error event."""
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump(mode="json")

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status_code, headers=self.headers)


def _server_error(message: str, status_code: int = 500, code: str | None = None) -> OpenAIError:
    return OpenAIError(status_code, message, "server_error", code=code)


def internal_error() -> OpenAIError:
    """A bug of ours, said as OpenAI says it (the details go to the log, not the client)."""
    return _server_error(INTERNAL_ERROR_MESSAGE)


def stream_error(exc: Exception, draining: bool) -> OpenAIError:
    """What a stream that has started (its 200 sent) says when `exc` ends it: the engine's
    error as its status would have said it (the drain's, on SIGTERM), or a bug of ours as a
    500 would (logged with its traceback)."""
    if isinstance(exc, EngineError):
        logger.warning("stream failed: %s", exc)
        return shutting_down() if draining else from_engine_error(exc)
    logger.error("stream failed on an unexpected error", exc_info=exc)
    return internal_error()


# -- engine errors --------------------------------------------------------------------------


def from_engine_error(exc: EngineError) -> OpenAIError:
    """Map a typed engine error to its HTTP form. 5xx errors are logged here, and their
    messages (which may quote internal exceptions) are replaced by a generic one."""
    error = _map_engine_error(exc)
    if error.status_code >= 500:
        logger.error("%s: %s", type(exc).__name__, exc)
    return error


def _map_engine_error(exc: EngineError) -> OpenAIError:
    if isinstance(exc, PromptTooLongError):  # before its base class, InvalidRequestError
        return OpenAIError(400, exc.message, param=exc.param, code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return OpenAIError(400, exc.message, param=exc.param, code=exc.code)
    # The next two come from the admin prefix reload; their messages are for the operator.
    if isinstance(exc, RegistryFileError):
        return OpenAIError(400, str(exc), code="invalid_prefix_file")
    if isinstance(exc, PrefixBudgetError):
        return OpenAIError(400, str(exc), code="prefix_budget_exceeded")
    if isinstance(exc, EngineUnavailableError):  # its message is ours, not an exception's
        headers = {"Retry-After": "1"}
        return OpenAIError(
            503, str(exc), "server_error", code="engine_unavailable", headers=headers
        )
    if isinstance(exc, EngineDeadError):
        message = "The inference engine has stopped; this server cannot serve requests."
        return _server_error(message, status_code=503, code="engine_unavailable")
    if isinstance(exc, ModelLoadError):
        return _server_error(f"The model could not be loaded: {exc}", code="model_load_failed")
    return _server_error(INTERNAL_ERROR_MESSAGE)  # RequestFailedError and anything newer


# -- request validation ---------------------------------------------------------------------

_TEMPLATES = {
    "missing_required_parameter": "Missing required parameter: {target}.",
    "invalid_type": "Invalid type for {target}: {detail}.",
    "invalid_value": "Invalid value for {target}: {detail}.",
    "unsupported_parameter": "Unsupported parameter: {target} {detail}.",
    "unsupported_value": "Unsupported value: {target} {detail}.",
}
_EXPECTED_TYPES = {
    "string_type": "a string",
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
}


def status_of(exc: Exception) -> int:
    """The HTTP status the installed handlers will answer `exc` with."""
    if isinstance(exc, OpenAIError):
        return exc.status_code
    if isinstance(exc, EngineError):
        return from_engine_error(exc).status_code
    if isinstance(exc, ClientGone):
        return CLIENT_GONE_STATUS
    return 400 if isinstance(exc, ValidationError) else 500


def from_validation_error(exc: ValidationError) -> OpenAIError:
    """400 for the first error, `param` written as OpenAI does: "messages[0].content[1]"."""
    error = exc.errors(include_url=False)[0]
    param = error_param(error["loc"])
    code, detail = _code_and_detail(error)
    target = f"'{param}'" if param else "the request body"
    message = _TEMPLATES[code].format(target=target, detail=detail.rstrip("."))
    return OpenAIError(400, message, param=param, code=code)


def error_param(loc: tuple[int | str, ...]) -> str | None:
    """("messages", 0, "content") -> "messages[0].content"; () -> None."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        else:
            param += f".{part}" if param else part
    return param or None


def _code_and_detail(error: ErrorDetails) -> tuple[str, str]:
    kind = error["type"]
    if kind in _TEMPLATES:  # raised by gateway.protocol, whose messages fit the templates
        return kind, error["msg"]
    if kind == "missing":
        return "missing_required_parameter", ""
    if kind in _EXPECTED_TYPES:
        got = json_type_name(error["input"])
        return "invalid_type", f"expected {_EXPECTED_TYPES[kind]}, but got {got} instead"
    msg = error["msg"].removeprefix("Value error, ").replace(" after validation", "")
    # JSON's words, as OpenAI writes them.
    msg = msg.replace("List should", "Array should").replace("Dictionary should", "Object should")
    return "invalid_value", msg[:1].lower() + msg[1:]


def invalid_json(detail: str) -> OpenAIError:
    message = (
        f"We could not parse the JSON body of your request ({detail}). "
        "The API expects a JSON object with the request's parameters."
    )
    return OpenAIError(400, message, code="invalid_json")


def validate(model: type[T], body: dict[str, Any], context: dict[str, Any] | None = None) -> T:
    """`context`: pydantic's validation context (a chat request reads the served model's
    "tool_format" from it)."""
    try:
        return model.model_validate(body, context=context)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


# -- errors the gateway raises itself -------------------------------------------------------


class ClientGone(Exception):
    """The client disconnected before its request was answered: nothing can be sent any more.
    Counted in the request metrics as 499 (nginx's "client closed request")."""


CLIENT_GONE_STATUS = 499


def payload_too_large(limit: int) -> OpenAIError:
    message = (
        f"The request body is larger than this server accepts ({limit} bytes, --max-request-bytes)."
    )
    return OpenAIError(413, message, code="request_too_large")


def request_timeout(seconds: float) -> OpenAIError:
    message = f"The request body did not arrive within {seconds:g} s (--request-read-timeout)."
    return OpenAIError(408, message, code="request_timeout", headers={"Connection": "close"})


def unsupported_media_type(media_type: str) -> OpenAIError:
    message = (
        f"Unsupported Content-Type '{media_type}': send the request body as JSON with "
        "'Content-Type: application/json'."
    )
    return OpenAIError(415, message, code="unsupported_media_type")


def shutting_down() -> OpenAIError:
    """503 for requests that arrive, or are still running, while the server drains."""
    message = "The server is shutting down and no longer accepts requests; retry elsewhere."
    headers = {"Retry-After": "1"}
    return OpenAIError(503, message, "server_error", code="server_shutting_down", headers=headers)


def unknown_model(name: str) -> OpenAIError:
    message = f"The model `{name}` does not exist or you do not have access to it."
    return OpenAIError(404, message, param="model", code="model_not_found")


def unauthorized() -> OpenAIError:
    message = (
        "Incorrect API key provided. Send the server's API key as 'Authorization: Bearer <key>'."
    )
    headers = {"WWW-Authenticate": "Bearer"}
    return OpenAIError(401, message, code="invalid_api_key", headers=headers)


def forbidden(
    message: str = "This API key is not allowed to use the admin endpoints.",
) -> OpenAIError:
    return OpenAIError(403, message, "permission_error", code="insufficient_permissions")


def too_many_requests(retry_after: float) -> OpenAIError:
    """429 with `Retry-After` in whole seconds (at least 1)."""
    seconds = max(1, math.ceil(retry_after))
    message = (
        "Too many requests are waiting to start on this server (--max-waiting). "
        f"Retry after {seconds} s."
    )
    headers = {"Retry-After": str(seconds)}
    return OpenAIError(429, message, "requests", code="rate_limit_exceeded", headers=headers)


def not_ready(detail: str | None = None) -> OpenAIError:
    """503 while the model and prefixes load; `detail` says why, e.g. a failed load."""
    message = "The server is not ready: it is still loading the model and its prefixes."
    if detail:
        message = f"The server is not ready: {detail}"
    headers = {"Retry-After": "1"}
    return OpenAIError(503, message, "server_error", code="not_ready", headers=headers)


# -- handlers -------------------------------------------------------------------------------


def install_error_handlers(app: Starlette) -> None:
    """Make every error the app can raise OpenAI-shaped."""
    app.add_exception_handler(OpenAIError, _handle_openai_error)
    app.add_exception_handler(EngineError, _handle_engine_error)
    app.add_exception_handler(ValidationError, _handle_validation_error)
    app.add_exception_handler(HTTPException, _handle_http_exception)
    app.add_exception_handler(ClientGone, _handle_client_gone)
    app.add_exception_handler(Exception, _handle_unexpected_error)


async def _handle_openai_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return exc.response()


async def _handle_engine_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, EngineError)
    if getattr(request.app.state, "gateway", None) and request.app.state.gateway.is_draining:
        return shutting_down().response()  # the drain ended this request
    return from_engine_error(exc).response()


async def _handle_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ValidationError)
    return from_validation_error(exc).response()


async def _handle_http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    method, path = request.method, request.url.path
    if exc.status_code == 404:
        error = OpenAIError(404, f"Invalid URL ({method} {path})")
    elif exc.status_code == 405:
        message = f"Method {method} is not allowed for {path}."
        error = OpenAIError(405, message, code="method_not_allowed")
    elif exc.status_code >= 500:
        error = _server_error(exc.detail, status_code=exc.status_code)
    else:
        error = OpenAIError(exc.status_code, exc.detail)
    error.headers.update(exc.headers or {})  # keeps 405's Allow
    return error.response()


async def _handle_client_gone(request: Request, exc: Exception) -> Response:
    logger.debug("client left before %s %s was answered", request.method, request.url.path)
    return Response(status_code=CLIENT_GONE_STATUS)  # sent to nobody: the server drops it


async def _handle_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises after this handler so the server logs it too; we log the route.
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return internal_error().response()
