"""GET /openapi.json: every route the app serves, described from the validating models, with
the bearer scheme exactly where the configuration asks for a key."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.routing import Route

from engine import EngineConfig
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.routes.openapi import openapi_schema

ENGINE = EngineConfig()


def _secured(schema: dict[str, Any]) -> set[str]:
    return {
        path
        for path, methods in schema["paths"].items()
        for operation in methods.values()
        if operation.get("security")
    }


def test_every_served_route_is_described_with_its_methods() -> None:
    app = create_app(GatewayConfig(engine=ENGINE))
    schema = openapi_schema(GatewayConfig(engine=ENGINE))
    served = {
        (route.path.replace(":path}", "}"), method.lower())  # Starlette's converter syntax
        for route in app.routes
        if isinstance(route, Route) and route.path != "/openapi.json"
        for method in route.methods or ()
        if method != "HEAD"
    }
    described = {(path, method) for path, ops in schema["paths"].items() for method in ops}
    assert described == served


def test_request_and_response_bodies_are_the_validating_models() -> None:
    schema = openapi_schema(GatewayConfig(engine=ENGINE))
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    ok = chat["responses"]["200"]["content"]
    assert set(ok) == {"application/json", "text/event-stream"}
    assert set(chat["responses"]) == {"200", "400", "401", "404", "408", "413", "415", "429", "503"}
    match = schema["paths"]["/v1/prefixes/match"]["post"]["requestBody"]
    assert match["content"]["application/json"]["schema"] == {
        "anyOf": [
            {"$ref": "#/components/schemas/ChatCompletionRequest"},
            {"$ref": "#/components/schemas/CompletionRequest"},
        ]
    }
    message = schema["components"]["schemas"]["ChatMessage"]
    content_rule, tool_result_rule, tool_calls_rule = message["allOf"]
    assert content_rule["then"] == {
        "required": ["content"],
        "properties": {"content": {"not": {"type": "null"}}},
    }
    assert tool_result_rule["if"]["properties"]["role"] == {"enum": ["tool"]}
    assert tool_result_rule["then"]["required"] == ["tool_call_id"]
    assert tool_calls_rule["if"]["properties"]["role"] == {"enum": ["assistant"]}


@pytest.mark.parametrize(
    ("keys", "secured"),
    [
        ({}, set()),
        (
            {"api_keys": ("k",)},
            {
                "/v1/chat/completions",
                "/v1/completions",
                "/v1/responses",
                "/v1/responses/{id}",
                "/v1/models",
                "/v1/models/{model}",
                "/v1/prefixes",
                "/v1/prefixes/reload",
                "/v1/prefixes/match",
                "/tokenize",
                "/detokenize",
            },
        ),
        ({"admin_api_key": "a"}, {"/v1/prefixes", "/v1/prefixes/reload", "/v1/prefixes/match"}),
        ({"metrics_api_key": "m"}, {"/metrics"}),
    ],
)
def test_bearer_scheme_where_a_key_is_configured(keys: dict[str, str], secured: set[str]) -> None:
    schema = openapi_schema(GatewayConfig(engine=ENGINE, **keys))
    assert _secured(schema) == secured
    schemes = schema["components"].get("securitySchemes")
    assert schemes == ({"bearerAuth": {"type": "http", "scheme": "bearer"}} if secured else None)
