"""GET /openapi.json: every route this server answers, its bodies generated from the same
pydantic models that validate requests and serialise responses.

The document follows the server's configuration: routes that need a key declare the bearer
scheme only when a key is configured (a server without keys accepts anonymous calls, and a
document claiming otherwise would be wrong).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.admission import gateway_of
from gateway.config import GatewayConfig
from gateway.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from gateway.protocol.admin import (
    HealthResponse,
    MatchResponse,
    PrefixList,
    ReloadResponse,
)
from gateway.protocol.response_objects import DeletedResponse, ResponseObject
from gateway.protocol.responses_request import ResponsesRequest
from gateway.protocol.tokens import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)


@dataclass(frozen=True)
class _Route:
    path: str
    method: str
    summary: str
    response: type[BaseModel] | None  # None: not JSON (see `media_type`)
    body: tuple[type[BaseModel], ...] = ()  # one of these
    auth: str | None = "api"  # "api", "admin", "metrics" or None
    errors: tuple[int, ...] = ()
    streams: bool = False  # `"stream": true` answers text/event-stream
    media_type: str = "application/json"
    path_params: tuple[str, ...] = ()  # string parameters in `path`


# Path parameters are ids: one or more characters, no control characters (a newline in a URL
# path is not routed at all).
_PATH_PARAM = {"type": "string", "pattern": "^[^\\x00-\\x1f\\x7f]+$"}
_GENERATION_ERRORS = (400, 401, 404, 408, 413, 415, 429, 503)
_ROUTES = (
    _Route(
        "/v1/chat/completions",
        "post",
        "Create a chat completion",
        ChatCompletionResponse,
        (ChatCompletionRequest,),
        errors=_GENERATION_ERRORS,
        streams=True,
    ),
    _Route(
        "/v1/completions",
        "post",
        "Create a completion",
        CompletionResponse,
        (CompletionRequest,),
        errors=_GENERATION_ERRORS,
        streams=True,
    ),
    _Route(
        "/v1/responses",
        "post",
        "Create a response (the Responses API)",
        ResponseObject,
        (ResponsesRequest,),
        errors=_GENERATION_ERRORS,
        streams=True,
    ),
    _Route(
        "/v1/responses/{id}",
        "get",
        "Retrieve a kept response",
        ResponseObject,
        errors=(401, 404),
        path_params=("id",),
    ),
    _Route(
        "/v1/responses/{id}",
        "delete",
        "Forget a kept response",
        DeletedResponse,
        errors=(401, 404),
        path_params=("id",),
    ),
    _Route("/v1/models", "get", "List the served model", ModelList, errors=(401, 503)),
    _Route(
        "/v1/models/{model}",
        "get",
        "Retrieve the served model",
        ModelCard,
        errors=(401, 404, 503),
        path_params=("model",),
    ),
    _Route(
        "/v1/prefixes",
        "get",
        "List the registered prefixes with their statistics",
        PrefixList,
        auth="admin",
        errors=(401, 403, 503),
    ),
    _Route(
        "/v1/prefixes/reload",
        "post",
        "Re-read the prefixes file and fill the new or changed entries",
        ReloadResponse,
        auth="admin",
        errors=(400, 401, 403, 503),
    ),
    _Route(
        "/v1/prefixes/match",
        "post",
        "Which registered prefix a chat or completion body hits, or where it diverged",
        MatchResponse,
        (ChatCompletionRequest, CompletionRequest),
        auth="admin",
        errors=(400, 401, 403, 408, 413, 415, 503),
    ),
    _Route(
        "/tokenize",
        "post",
        "The prompt a chat or completion body gives the model, as token ids",
        TokenizeResponse,
        (TokenizeChatRequest, TokenizeCompletionRequest),
        errors=(400, 401, 404, 408, 413, 415, 503),
    ),
    _Route(
        "/detokenize",
        "post",
        "The text of token ids",
        DetokenizeResponse,
        (DetokenizeRequest,),
        errors=(400, 401, 404, 408, 413, 415, 503),
    ),
    _Route(
        "/health", "get", "200 once the model and every prefix are ready", HealthResponse, (), None
    ),
    _Route(
        "/metrics",
        "get",
        "Prometheus metrics",
        None,
        auth="metrics",
        errors=(401,),
        media_type="text/plain",
    ),
)


def openapi_schema(config: GatewayConfig) -> dict[str, Any]:
    refs, defs = _component_schemas()
    schemes = _security_schemes(config)
    paths: dict[str, Any] = {}
    for route in _ROUTES:
        paths.setdefault(route.path, {})[route.method] = _operation(route, refs, schemes)
    components: dict[str, Any] = {"schemas": defs}
    if any(schemes.values()):
        components["securitySchemes"] = {
            "bearerAuth": {"type": "http", "scheme": "bearer"},
        }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "prefixgate",
            "version": "0.1.0",
            "description": "OpenAI-compatible API over a prefix-caching engine",
        },
        "paths": paths,
        "components": components,
    }


def _component_schemas() -> tuple[dict[type[BaseModel], dict[str, Any]], dict[str, Any]]:
    models: list[type[BaseModel]] = [ErrorResponse]
    for route in _ROUTES:
        for model in (*route.body, route.response):
            if model is not None and model not in models:
                models.append(model)
    keyed, defs = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
    )
    return {m: keyed[(m, "validation")] for m in models}, defs.get("$defs", {})


def _security_schemes(config: GatewayConfig) -> dict[str, bool]:
    """Which kinds of route need a key under this configuration."""
    return {
        "api": config.has_api_keys,
        "admin": config.has_api_keys or config.admin_api_key is not None,
        "metrics": config.metrics_api_key is not None,
    }


def _operation(
    route: _Route, refs: dict[type[BaseModel], dict[str, Any]], schemes: dict[str, bool]
) -> dict[str, Any]:
    error = {
        "description": "OpenAI error object",
        "content": {"application/json": {"schema": refs[ErrorResponse]}},
    }
    operation: dict[str, Any] = {
        "summary": route.summary,
        "responses": {
            "200": {"description": "OK", "content": _content(route, refs)},
            **{str(status): error for status in route.errors},
        },
    }
    if route.path_params:
        operation["parameters"] = [
            {"name": name, "in": "path", "required": True, "schema": _PATH_PARAM}
            for name in route.path_params
        ]
    if route.body:
        options = [refs[m] for m in route.body]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": schema}},
        }
    if route.auth is not None and schemes[route.auth]:
        operation["security"] = [{"bearerAuth": []}]
    return operation


def _content(route: _Route, refs: dict[type[BaseModel], dict[str, Any]]) -> dict[str, Any]:
    if route.response is None:
        return {route.media_type: {"schema": {"type": "string"}}}
    content: dict[str, Any] = {"application/json": {"schema": refs[route.response]}}
    if route.streams:
        # Server-sent events: `data: <chunk JSON>` lines, then `data: [DONE]` (the Responses
        # API: `event: <type>` and `data: <event JSON>`, ending with the response's state).
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return content


async def get_openapi(request: Request) -> Response:
    return JSONResponse(openapi_schema(gateway_of(request).config))
