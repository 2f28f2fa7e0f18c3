"""GET /openapi.json: the API's schema, generated from the same pydantic models that validate."""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)

_ROUTES: list[tuple[str, str, type[BaseModel] | None, type[BaseModel]]] = [
    ("/v1/chat/completions", "post", ChatCompletionRequest, ChatCompletionResponse),
    ("/v1/completions", "post", CompletionRequest, CompletionResponse),
    ("/v1/models", "get", None, ModelList),
]


@cache
def openapi_schema() -> dict[str, Any]:
    models: list[type[BaseModel]] = [ErrorResponse]
    for _, _, request, response in _ROUTES:
        models += [m for m in (request, response) if m is not None and m not in models]
    refs, defs = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
    )
    ref = {m: refs[(m, "validation")] for m in models}
    error = {
        "description": "OpenAI error object",
        "content": {"application/json": {"schema": ref[ErrorResponse]}},
    }
    paths: dict[str, Any] = {}
    for path, method, request, response in _ROUTES:
        operation: dict[str, Any] = {
            "responses": {
                "200": {
                    "description": "OK",
                    "content": {"application/json": {"schema": ref[response]}},
                },
                "400": error,
                "401": error,
                "404": error,
                "429": error,
                "503": error,
            }
        }
        if request is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": ref[request]}},
            }
        paths[path] = {method: operation}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "prefixgate",
            "version": "0.1.0",
            "description": "OpenAI-compatible API over a prefix-caching engine",
        },
        "paths": paths,
        "components": {"schemas": defs.get("$defs", {})},
    }


async def get_openapi(request: Request) -> Response:
    return JSONResponse(openapi_schema())
