"""Tool calling through the chat API (in-process, tiny Llama): forced calls (`required`, a
named function) valid against their schemas, streamed calls, tool results rendered back,
and the errors of bad tool requests. The tiny template takes no `tools`, so they are
described in the system turn (engine/tool_format.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from tests.helpers import tiny_app

MODEL = "tiny-llama"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {**CITY, "required": ["city"], "additionalProperties": False},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Weather in Paris?"}],
    "temperature": 0,
    "max_tokens": 120,
}
TOOL_CHAT = {**CHAT, "tools": [WEATHER, TIME], "parallel_tool_calls": False}


@pytest.fixture(scope="module")
def client(tiny_llama_path: Path) -> Iterator[TestClient]:
    with TestClient(tiny_app(tiny_llama_path)) as test_client:
        yield test_client


def _choice(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice: dict[str, Any] = response.json()["choices"][0]
    return choice


@pytest.mark.parametrize(
    ("tool_choice", "names"),
    [("required", {"get_weather", "get_time"}), (NAMED, {"get_weather"})],
    ids=["required", "named"],
)
def test_forced_tool_calls(client: TestClient, tool_choice: Any, names: set[str]) -> None:
    choice = _choice(client, {**TOOL_CHAT, "tool_choice": tool_choice})
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and re.fullmatch(r"call-[0-9a-f]{24}", call["id"])
    assert call["function"]["name"] in names
    arguments = json.loads(call["function"]["arguments"])
    assert isinstance(arguments, dict)
    if call["function"]["name"] == "get_weather":
        assert list(arguments) == ["city"] and len(arguments["city"]) <= 12


def test_a_streamed_call_arrives_whole(client: TestClient) -> None:
    body = {**TOOL_CHAT, "tool_choice": "required"}
    whole = _choice(client, body)["message"]["tool_calls"]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    deltas = [json.loads(e)["choices"][0] for e in events[:-1]]
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]) for c in calls] == [(0, whole[0]["function"])]
    assert all(not d["delta"].get("content") for d in deltas)
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_tool_choice_none_answers_in_text_after_a_tool_result(client: TestClient) -> None:
    arguments = json.dumps({"city": "Paris"})
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    messages = [
        *CHAT["messages"],  # type: ignore[misc]
        {"role": "assistant", "tool_calls": [call]},  # no content: as the SDK dumps it
        {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
    ]
    body = {**CHAT, "tools": [WEATHER], "messages": messages, "tool_choice": "none"}
    choice = _choice(client, {**body, "max_tokens": 8, "ignore_eos": True})
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert isinstance(choice["message"]["content"], str)


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools' to choose from"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "names 'x', which is not among 'tools'",
        ),
        (
            {"messages": [{"role": "tool", "content": "18 C"}]},
            "messages[0]",
            "a tool message needs the 'tool_call_id' it answers",
        ),
        (
            {"messages": [{"role": "user", "content": "hi", "tool_call_id": "c1"}]},
            "messages[0].tool_call_id",
            "only tool messages answer a tool call",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a+"},
            None,
            "one structured output constraint at a time, got tools and guided_regex",
        ),
    ],
)
def test_bad_tool_requests(
    client: TestClient, fields: dict[str, Any], param: str | None, message: str
) -> None:
    response = client.post("/v1/chat/completions", json={**CHAT, **fields})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
