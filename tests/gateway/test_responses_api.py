"""The Responses API in-process (tiny Llama), read through the official SDK where it can be:
a response is the chat completion it describes (same prompt, same greedy text, same usage),
its stream is the SDK's typed events in order, tools become function_call items, chained
turns continue the stored conversation, and bad requests get OpenAI errors naming the
Responses fields."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from starlette.testclient import TestClient

from engine import (
    HERMES,
    EngineDeadError,
    GrammarSpec,
    ReasoningFormat,
    RequestOutput,
    split_reasoning,
)
from gateway.protocol import ChatCompletionRequest
from gateway.protocol.response_objects import ResponseObject
from gateway.protocol.responses_request import ResponsesRequest
from gateway.routes import responses as route
from tests.helpers import tiny_app

MODEL = "tiny-llama"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
BASE = {"model": MODEL, "temperature": 0, "max_output_tokens": 12}


@pytest.fixture(scope="module")
def client(tiny_llama_path: Path) -> Iterator[TestClient]:
    with TestClient(tiny_app(tiny_llama_path)) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def sdk(client: TestClient) -> openai.OpenAI:
    # TestClient is an httpx.Client: the SDK talks to the app in-process.
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)


def _post(client: TestClient, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    response = client.post("/v1/responses", json=body)
    assert response.status_code == status, response.text
    data: dict[str, Any] = response.json()
    return data


def _chat(client: TestClient, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 12, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def _events(client: TestClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The SSE events, each checked: its `event:` line names its type."""
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    events = []
    for event_line, data_line in zip(lines[::2], lines[1::2], strict=True):
        event = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {event['type']}"
        events.append(event)
    return events


# -- a response is the chat completion it describes -------------------------------------------


def test_a_response_is_its_chat_completion(client: TestClient, sdk: openai.OpenAI) -> None:
    response = sdk.responses.create(
        model=MODEL, input="Hello there", instructions="Be brief.", temperature=0,
        max_output_tokens=12,
    )  # fmt: skip
    chat = _chat(
        client,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat["choices"][0]["message"]["content"]
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    usage = response.usage
    assert usage is not None
    assert usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert usage.output_tokens == chat["usage"]["completion_tokens"]
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # The chat came second with the same prompt: the automatic prefix cache served every
    # full block of it but the last token's (4-token blocks).
    cached = chat["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert usage.input_tokens_details.cached_tokens == 0
    assert cached == (usage.input_tokens - 1) // 4 * 4
    assert response.instructions == "Be brief." and response.temperature == 0
    # It was first: it wrote every full block of its prompt into the cache; the same input
    # again reads them and writes nothing.
    assert usage.input_tokens_details.cache_write_tokens == usage.input_tokens // 4 * 4
    again = sdk.responses.create(
        model=MODEL, input="Hello there", instructions="Be brief.", temperature=0,
        max_output_tokens=12,
    )  # fmt: skip
    assert again.usage is not None
    assert again.usage.input_tokens_details.cached_tokens == cached
    assert again.usage.input_tokens_details.cache_write_tokens == 0
    assert (response.completed_at is None) == (response.status == "incomplete")


def test_a_response_is_the_sdks_response_type(client: TestClient) -> None:
    """Every field the SDK's `Response` type requires is there, with its type (strict
    clients and generated ones validate what they receive); `completed_at` only once
    completed (a grammar's end completes a short answer, a length cut does not)."""
    flag = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    schema = {
        "type": "json_schema",
        "name": "flag",
        "schema": {**flag, "additionalProperties": False},
    }
    done = {**BASE, "input": "Is it on?", "max_output_tokens": 40, "text": {"format": schema}}
    cut = {**BASE, "input": "Count", "max_output_tokens": 2}
    for body, status in ((done, "completed"), (cut, "incomplete")):
        created = _post(client, body)
        assert created["status"] == status
        parsed = openai.types.responses.Response.model_validate(created)
        assert parsed.usage is not None
        assert (parsed.completed_at is not None) == (status == "completed")
        if parsed.completed_at is not None:
            assert parsed.completed_at >= parsed.created_at


def test_length_limit_makes_an_incomplete_response(client: TestClient) -> None:
    body = {**BASE, "input": "Count to one hundred", "max_output_tokens": 3}
    response = _post(client, body)
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["usage"]["output_tokens"] == 3
    assert response["output"][0]["status"] == "incomplete"
    events = _events(client, body)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["status"] == "incomplete"


def test_message_items_and_roles_render_like_chat_messages(client: TestClient) -> None:
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]},
        {"role": "user", "content": "How are you?"},
    ]
    messages = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "How are you?"},
    ]
    response = _post(client, {**BASE, "input": items})
    chat = _chat(client, messages)
    assert response["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert response["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]


# -- streaming ---------------------------------------------------------------------------------


def test_stream_events_in_order_and_equal_to_the_response(
    client: TestClient, sdk: openai.OpenAI
) -> None:
    body = {**BASE, "input": "Tell me a story", "max_output_tokens": 20}
    whole = _post(client, body)
    events = _events(client, body)
    types = [event["type"] for event in events]
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole['status']}",
    ]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole["output"][0]["content"][0]["text"]
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == text
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in events[3:-2] if "item_id" in e)
    # Equal but for cached tokens: the stream came second and hit the automatic cache.
    assert final["usage"]["input_tokens_details"]["cached_tokens"] > 0
    final["usage"]["input_tokens_details"] = whole["usage"]["input_tokens_details"]
    assert final["usage"] == whole["usage"]
    # The SDK reads the same stream as its typed events.
    with sdk.responses.stream(**{k: v for k, v in body.items() if k != "model"}, model=MODEL) as s:
        sdk_events = list(s)
    assert [event.type for event in sdk_events] == types
    assert sdk_events[-1].response.output_text == text  # type: ignore[union-attr]


# -- tools -------------------------------------------------------------------------------------


def test_required_tool_makes_a_function_call_item(client: TestClient) -> None:
    body = {
        **BASE,
        "input": "Weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 80,
    }
    response = _post(client, body)
    assert response["status"] == "completed"
    [call] = response["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["parameters"])
    assert response["tools"] == [WEATHER] and response["tool_choice"] == "required"

    events = _events(client, body)
    types = [event["type"] for event in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = events[4]
    assert done["name"] == "get_weather" and done["arguments"] == events[3]["delta"]
    assert events[-1]["response"]["output"][0]["arguments"] == done["arguments"]


def test_named_tool_choice_calls_that_tool(client: TestClient) -> None:
    second = {**WEATHER, "name": "get_time", "parameters": {"type": "object"}}
    body = {
        **BASE,
        "input": "What now?",
        "tools": [second, WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 80,
    }
    [call] = _post(client, body)["output"]
    assert call["name"] == "get_weather"


def test_a_call_cut_by_max_output_tokens_is_an_incomplete_function_call(
    client: TestClient,
) -> None:
    """Cut after the call's name: a function_call item with the arguments written so far,
    status incomplete (completed once its arguments are whole), and no message holding the
    call's markup."""
    body = {
        **BASE,
        "input": "Weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
    }
    whole = _post(client, {**body, "max_output_tokens": 80})
    [call] = whole["output"]
    needed = whole["usage"]["output_tokens"]
    seen_partial = False
    for max_output_tokens in range(1, needed):
        response = _post(client, {**body, "max_output_tokens": max_output_tokens})
        assert response["status"] == "incomplete"
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}
        for item in response["output"]:
            if item["type"] == "message":  # before the name: an empty answer, no markup
                assert [part["text"] for part in item["content"]] in ([], [""]), item
                continue
            assert item["type"] == "function_call"
            written = item["arguments"]
            assert call["arguments"].replace(" ", "").startswith(written.replace(" ", ""))
            # whole arguments (only the call's closing was cut) make a completed call
            is_whole = written.replace(" ", "") == call["arguments"].replace(" ", "")
            assert item["name"] == "get_weather"
            assert item["status"] == ("completed" if is_whole else "incomplete")
            seen_partial = seen_partial or bool(written)
    assert seen_partial


def test_tool_results_render_like_chat_tool_messages(client: TestClient) -> None:
    arguments = json.dumps({"city": "Paris"})
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": arguments,
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"},
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    tools = {"tools": [WEATHER], "tool_choice": "none"}
    response = _post(client, {**BASE, "input": items, **tools})
    function = {k: v for k, v in WEATHER.items() if k != "type"}
    chat_tools = {"tools": [{"type": "function", "function": function}], "tool_choice": "none"}
    chat = _chat(client, messages, **chat_tools)
    assert response["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert response["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]


def test_structured_text_format_validates(client: TestClient, sdk: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {
            "label": {"enum": ["yes", "no"]},
            "score": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["label", "score"],
        "additionalProperties": False,
    }
    text = {"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}}
    response = sdk.responses.create(
        model=MODEL, input="Is it?", text=text, temperature=0, max_output_tokens=60
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"


def test_tools_with_a_structured_answer(client: TestClient) -> None:
    """An agent with tools and a structured final output sends both: with tool_choice auto
    the one grammar is "a call, or JSON of the format" (engine test_tool_format); with
    tool_choice none the answer follows the format."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}},
              "required": ["answer"], "additionalProperties": False}  # fmt: skip
    text = {"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}}
    body = {**BASE, "input": "Weather?", "tools": [WEATHER], "text": text}
    chat = ChatCompletionRequest.model_validate(
        ResponsesRequest.model_validate(body).chat_payload([])
    )
    [(field, grammar)] = chat.constraints
    answer = GrammarSpec.json_schema(schema)
    assert field == "tools"
    assert grammar == HERMES.grammar(
        chat.tool_dicts(), None, is_required=False, parallel=True, answer=answer
    )
    response = _post(client, {**body, "tool_choice": "none", "max_output_tokens": 80})
    assert response["status"] == "completed"
    [message] = response["output"]
    jsonschema.validate(json.loads(message["content"][0]["text"]), schema)


# -- logprobs ------------------------------------------------------------------------------


def test_logprobs_when_included(client: TestClient) -> None:
    body = {**BASE, "input": "Hi", "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    response = _post(client, body)
    part = response["output"][0]["content"][0]
    assert len(part["logprobs"]) == response["usage"]["output_tokens"]
    assert all(len(entry["top_logprobs"]) == 2 for entry in part["logprobs"])
    deltas = [e for e in _events(client, body) if e["type"] == "response.output_text.delta"]
    assert [entry for e in deltas for entry in e["logprobs"]] == part["logprobs"]
    assert _post(client, {**BASE, "input": "Hi"})["output"][0]["content"][0]["logprobs"] is None


# -- stored responses and chained turns ---------------------------------------------------------


def test_chained_turn_continues_the_stored_conversation(client: TestClient) -> None:
    first = _post(client, {**BASE, "input": "My name is Ada.", "instructions": "Be kind."})
    answer = first["output"][0]["content"][0]["text"]
    second = _post(
        client, {**BASE, "input": "What is my name?", "previous_response_id": first["id"]}
    )
    assert second["previous_response_id"] == first["id"]
    # The previous instructions are not carried over (OpenAI's rule); its turns are.
    chat = _chat(
        client,
        [
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "What is my name?"},
        ],
    )
    assert second["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert second["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]


def test_chained_tool_round_trip(client: TestClient) -> None:
    calling = _post(
        client,
        {**BASE, "input": "Weather in Paris?", "tools": [WEATHER], "tool_choice": "required",
         "parallel_tool_calls": False, "max_output_tokens": 80},
    )  # fmt: skip
    [call] = calling["output"]
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "18 C"}
    answer = _post(
        client,
        {**BASE, "input": [result], "tools": [WEATHER], "previous_response_id": calling["id"]},
    )
    assert answer["status"] in ("completed", "incomplete")
    assert answer["usage"]["input_tokens"] > calling["usage"]["input_tokens"]


def test_retrieve_and_delete_a_stored_response(client: TestClient) -> None:
    created = _post(client, {**BASE, "input": "Keep me"})
    fetched = client.get(f"/v1/responses/{created['id']}")
    assert fetched.status_code == 200 and fetched.json() == created
    # a route under a kept response that this server does not serve (OpenAI's input_items
    # list) is an unknown URL, not a kept response that "was never stored"
    items = client.get(f"/v1/responses/{created['id']}/input_items")
    assert items.status_code == 404, items.text
    assert items.json()["error"]["message"].startswith("Invalid URL (GET /v1/responses/")
    assert items.json()["error"]["code"] != "response_not_found"
    deleted = client.delete(f"/v1/responses/{created['id']}")
    assert deleted.json() == {"id": created["id"], "object": "response", "deleted": True}
    assert client.get(f"/v1/responses/{created['id']}").status_code == 404


def test_unknown_or_unstored_ids_are_404(client: TestClient) -> None:
    unstored = _post(client, {**BASE, "input": "Forget me", "store": False})
    assert unstored["store"] is False
    for response_id in (unstored["id"], "resp_unknown"):
        error = _post(
            client, {**BASE, "input": "Hi", "previous_response_id": response_id}, status=404
        )["error"]
        assert error["param"] == "previous_response_id"
        assert error["code"] == "response_not_found" and response_id in error["message"]
        got = client.get(f"/v1/responses/{response_id}")
        assert got.status_code == 404 and got.json()["error"]["code"] == "response_not_found"


def test_the_sdk_raises_not_found_for_an_unknown_previous_response(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="resp_gone"):
        sdk.responses.create(model=MODEL, input="Hi", previous_response_id="resp_gone")


def _server(tiny_llama_path: Path, response_store: str) -> TestClient:
    """Another server (another app, engine and store) over the same model."""
    return TestClient(tiny_app(tiny_llama_path, {"response_store": response_store}))


def test_servers_on_one_file_share_responses_and_keep_them_over_a_restart(
    tiny_llama_path: Path, tmp_path: Path
) -> None:
    store = f"sqlite:{tmp_path / 'responses.sqlite3'}"
    with _server(tiny_llama_path, store) as one, _server(tiny_llama_path, store) as two:
        first = _post(one, {**BASE, "input": "My name is Ada."})
        answer = first["output"][0]["content"][0]["text"]
        assert two.get(f"/v1/responses/{first['id']}").json() == first
        second = _post(
            two, {**BASE, "input": "What is my name?", "previous_response_id": first["id"]}
        )
        # The second server continued the conversation the first one stored.
        chat = _chat(
            two,
            [
                {"role": "user", "content": "My name is Ada."},
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "What is my name?"},
            ],
        )
        assert second["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
        assert second["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    # Both closed their store as they shut down: the last connection folds the WAL in.
    assert not (tmp_path / "responses.sqlite3-wal").exists()
    with _server(tiny_llama_path, store) as restarted:
        for kept in (first, second):
            assert restarted.get(f"/v1/responses/{kept['id']}").json() == kept
        third = _post(
            restarted, {**BASE, "input": "And again?", "previous_response_id": second["id"]}
        )
        assert third["usage"]["input_tokens"] > second["usage"]["input_tokens"]


def test_responses_kept_in_memory_end_with_their_server(tiny_llama_path: Path) -> None:
    with _server(tiny_llama_path, "memory") as server:
        created = _post(server, {**BASE, "input": "Keep me"})
        assert server.get(f"/v1/responses/{created['id']}").json() == created
    with _server(tiny_llama_path, "memory") as restarted:
        gone = restarted.get(f"/v1/responses/{created['id']}")
        assert gone.status_code == 404
        assert gone.json()["error"]["code"] == "response_not_found"


# -- bad requests ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        (
            {"input": [{"type": "item_reference", "id": "msg_1"}]},
            "input[0].type",
            "unsupported_value",
        ),
        (
            {"input": [{"type": "reasoning", "id": "rs_1"}]},
            "input[0].summary",
            "missing_required_parameter",
        ),
        ({"input": [{"role": "user"}]}, "input[0].content", "missing_required_parameter"),
        (
            {"input": [{"type": "function_call", "name": "f"}]},
            "input[0].call_id",
            "missing_required_parameter",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c9", "output": "x"}]},
            "input[0].call_id",
            "invalid_value",
        ),
        ({"max_output_tokens": 600}, "max_output_tokens", "context_length_exceeded"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
            "unsupported_value",
        ),
        ({"input": 5}, "input", "invalid_type"),
        ({"input": []}, "input", "invalid_value"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]", "unsupported_value"),
        ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
            "invalid_value",
        ),
        (
            {"text": {"format": {"type": "json_schema", "schema": {}}}},
            "text.format.name",
            "missing_required_parameter",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}},
            "text.format.name",
            "invalid_value",
        ),
        ({"truncation": "auto"}, "truncation", "unsupported_value"),
        ({"background": True}, "background", "unsupported_value"),
        ({"conversation": "conv_1"}, "conversation", "unsupported_parameter"),
        ({"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
        ({"model": "gpt-9"}, "model", "model_not_found"),
    ],
)
def test_bad_requests_name_the_responses_field(
    client: TestClient, fields: dict[str, Any], param: str, code: str
) -> None:
    body = {**BASE, "input": "Hi", **fields}
    response = client.post("/v1/responses", json=body)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error


def test_engine_errors_name_the_responses_fields(client: TestClient) -> None:
    too_long = _post(client, {**BASE, "input": "word " * 600}, status=400)["error"]
    assert too_long["code"] == "context_length_exceeded" and too_long["param"] == "input"
    bad = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}
    error = _post(client, {**BASE, "input": "Hi", "text": bad}, status=400)["error"]
    assert error["param"] == "text.format"


# -- a failure mid-stream ----------------------------------------------------------------------


class _FailingJob:
    """A job whose engine dies after its first token."""

    def __init__(self, gateway: Any) -> None:
        self.gateway = gateway

    async def run(self) -> AsyncIterator[tuple[Any, RequestOutput]]:
        out = RequestOutput(
            "r", "Hel", [1], num_prompt_tokens=2, num_completion_tokens=1, num_cached_tokens=0
        )
        yield None, out
        raise EngineDeadError("stopped")


async def _collect(events: AsyncIterator[dict[str, str]]) -> list[dict[str, str]]:
    return [event async for event in events]


def test_a_failure_mid_stream_ends_with_response_failed(client: TestClient) -> None:
    import asyncio

    gateway = client.app.state.gateway  # type: ignore[attr-defined]
    body = ResponsesRequest.model_validate({**BASE, "input": "Hi"})
    job: Any = _FailingJob(gateway)
    run = route.ResponseRun(job, ResponseObject(model=MODEL), body, [], None, calls=None)
    events = asyncio.run(_collect(route._stream(run, gateway)))
    types = [event["event"] for event in events]
    assert types[-1] == "response.failed" and "response.output_text.delta" in types
    failed = json.loads(events[-1]["data"])["response"]
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == "engine_unavailable"


def test_a_thinking_models_reasoning_is_its_own_output_item(
    client: TestClient, sdk: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the served model thinks, its reasoning comes as a `reasoning` item before the
    message, streamed as reasoning_text events, and the SDK reads both; sent back as input,
    the reasoning item is taken. The tiny model writes no think tags, so the gateway is told
    that two spans of its greedy answer are the tags."""
    gateway = client.app.state.gateway  # type: ignore[attr-defined]
    body = {**BASE, "input": "Hi", "max_output_tokens": 24}
    monkeypatch.setattr(gateway, "reasoning_format", None)
    raw = _post(client, body)["output"][0]["content"][0]["text"]
    middle = len(raw) // 2
    tags = ReasoningFormat(raw[:3], raw[middle : middle + 3], -1, -2)
    thought, answer = split_reasoning(tags, raw)
    assert thought and answer, raw  # the spans split it in two

    monkeypatch.setattr(gateway, "reasoning_format", tags)
    response = sdk.responses.create(**{k: v for k, v in body.items() if k != "model"}, model=MODEL)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.status == "completed"
    assert [part.text for part in reasoning.content or []] == [thought]
    assert message.type == "message" and response.output_text == answer

    events = _events(client, body)
    types = [event["type"] for event in events]
    first_message = types.index("response.content_part.added")
    assert types.index("response.reasoning_text.done") < first_message
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == thought
    done = next(e for e in events if e["type"] == "response.reasoning_text.done")
    assert done["text"] == thought and done["output_index"] == 0
    texts = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(texts) == answer
    assert events[-1]["response"]["output"][0]["content"] == [
        {"type": "reasoning_text", "text": thought}
    ]

    cut = _post(client, {**body, "max_output_tokens": 2})  # inside the reasoning
    assert cut["status"] == "incomplete"
    assert [item["type"] for item in cut["output"]] == ["reasoning", "message"]
    assert cut["output"][0]["status"] == "incomplete"

    # the output sent back as input (as the Agents SDK does) is taken: the reasoning joins
    # the assistant turn after it (as reasoning_content, which this template does not write)
    returned = [item.model_dump(exclude_none=True) for item in response.output]
    follow_up = {**body}
    follow_up["input"] = [
        {"role": "user", "content": "Hi"},
        *returned,
        {"role": "user", "content": "And then?"},
    ]
    request = ResponsesRequest.model_validate(follow_up)
    assert request.input_messages()[1] == {
        "role": "assistant",
        "content": answer,
        "reasoning_content": thought,
    }
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And then?"},
    ]
    expected = _chat(client, turns)["usage"]["prompt_tokens"]
    assert _post(client, follow_up)["usage"]["input_tokens"] == expected
