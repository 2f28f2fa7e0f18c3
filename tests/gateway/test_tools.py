"""Tool calling through the chat API (in-process, tiny Llama): forced calls (`required`, a
named function) valid against their schemas, streamed calls, tool results rendered back,
and the errors of bad tool requests. The tiny template takes no `tools`, so they are
described in the system turn (engine/tool_format.py)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from engine import (
    GRANITE,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    MISTRAL_ARGS,
    PHI4_MINI,
    CallReader,
    ParsedToolCall,
    ToolFormat,
)
from gateway.protocol import ChatCompletionRequest
from gateway.tool_stream import ToolCallText
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
    # no content at all, not even the role delta's "": the SDK's stream helper would build
    # an answer of calls alone with content "" (and a content event) instead of null
    assert deltas[0]["delta"] == {"role": "assistant"}
    assert all(d["delta"].get("content") is None for d in deltas)
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


# --- templates that teach their own formats ---------------------------------------------------

TEMPLATES = Path(__file__).parents[1] / "engine/text/templates"
OWN_FORMATS = {
    "llama3": ("llama-3.2-instruct.jinja", LLAMA3_JSON),
    "phi4-mini": ("phi-4-mini-instruct.jinja", PHI4_MINI),
    "mistral": ("mistral-nemo-instruct.jinja", MISTRAL),
    "granite": ("granite-3.3-instruct.jinja", GRANITE),
    "ministral": ("ministral-3-reasoning.jinja", MISTRAL_ARGS),
}


@pytest.fixture(scope="module", params=list(OWN_FORMATS))
def own_format_client(
    request: pytest.FixtureRequest, tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TestClient]:
    """The tiny model served with a real model's chat template (`--chat-template`) that
    teaches its own call format: Llama 3.2's renders the tools, and calls are bare
    `{"name", "parameters"}` objects; Phi-4-mini's takes them in the system message's field,
    and calls are one `functools[...]` list; Mistral Nemo's renders them, calls are one
    `[TOOL_CALLS][...]` list, and past calls need nine-character ids; Granite 3's renders
    them and asks for one `<|tool_call|>[...]` list; Ministral 3's for
    `[TOOL_CALLS]name[ARGS]{...}`. Llama 3's prompts
    run to ~900 tokens (its markup is plain text to the tiny tokenizer): a copy of the model
    with a 2048-position limit."""
    path = tmp_path_factory.mktemp("long") / "tiny-llama"  # the model name requests use
    shutil.copytree(tiny_llama_path, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    template, tool_format = OWN_FORMATS[request.param]
    app = tiny_app(path, chat_template=str(TEMPLATES / template), max_model_len=2048)
    with TestClient(app) as test_client:
        assert app.state.gateway.tool_format is tool_format
        yield test_client


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_calls_in_the_models_own_format_come_back_as_tool_calls(
    own_format_client: TestClient, tool_choice: Any, stream: bool
) -> None:
    """Forced calls in the template's own format come back as OpenAI tool calls, whole or
    streamed (held back from the content), and the conversation goes on: the call and its
    result render back through the template."""
    body = {**TOOL_CHAT, "tool_choice": tool_choice}
    response = own_format_client.post("/v1/chat/completions", json=body).json()
    choice = response["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    names = {"get_weather"} if tool_choice == NAMED else {"get_weather", "get_time"}
    assert call["function"]["name"] in names
    arguments = json.loads(call["function"]["arguments"])
    assert isinstance(arguments, dict)
    if call["function"]["name"] == "get_weather":
        assert list(arguments) == ["city"]
    if stream:
        streamed = _streamed(own_format_client, body)
        assert streamed["message"]["content"] is None
        assert [c["function"] for c in streamed["message"]["tool_calls"]] == [call["function"]]
        return
    follow_up = [
        *TOOL_CHAT["messages"],
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "18 C"},
    ]
    # content None beside calls: the template gets the calls written as text, no None
    again = {**TOOL_CHAT, "messages": follow_up, "max_tokens": 1}
    answered = own_format_client.post("/v1/chat/completions", json=again)
    assert answered.status_code == 200, answered.text


@pytest.mark.parametrize(
    "tool_format",
    [HERMES, LLAMA3_JSON, PHI4_MINI, MISTRAL_ARGS],
    ids=["hermes", "llama3", "phi4-mini", "mistral-args"],
)
def test_a_stream_holds_back_text_that_starts_as_calls_do(tool_format: ToolFormat) -> None:
    """Text streams through unless it starts as the format's calls start (after any
    whitespace); held text is read as calls when the choice ends."""
    text = ToolCallText.of(CallReader(tool_format))
    assert text.feed("  ") == ""  # undecided yet
    assert text.feed("It is sunny.") == "  It is sunny."
    assert text.feed(" {") == " {"  # once streaming, the rest streams
    call = {"function": {"name": "f", "arguments": '{"x": 1}'}}
    written = tool_format.written([call])
    held = ToolCallText.of(CallReader(tool_format))
    assert held.feed(written[:3]) == "" and held.feed(written[3:]) == ""
    assert held.finish() == ("", [ParsedToolCall("f", '{"x": 1}')])
    assert ToolCallText.of(None).feed("{") == "{"
    # A forced call's opening is in the prompt: the output is the rest, held from the start
    forced = ToolCallText.of(tool_format.reader("f", is_required=True))
    assert forced.feed('{"x":') == "" and forced.feed("1}") == ""
    assert forced.finish() == ("", [ParsedToolCall("f", '{"x": 1}')])


def test_calls_tagged_by_a_special_token_are_read_from_text_that_keeps_it() -> None:
    """Mistral's `[TOOL_CALLS]` is a special token, which answers leave out by default: a
    request that may call tools keeps special tokens in its text (as vLLM does), one that
    may not leaves them out as asked."""
    tagged = replace(MISTRAL, token_tags=(("[TOOL_CALLS]", 5),))
    context = {"tool_format": tagged}
    body = {**TOOL_CHAT, "tool_choice": "auto"}
    params = ChatCompletionRequest.model_validate(body, context=context).to_sampling_params(64)
    assert params.skip_special_tokens is False
    for other in ({**body, "tool_choice": "none"}, CHAT):
        request = ChatCompletionRequest.model_validate(other, context=context)
        assert request.to_sampling_params(64).skip_special_tokens is True
    untagged = ChatCompletionRequest.model_validate(body, context={"tool_format": MISTRAL})
    assert untagged.to_sampling_params(64).skip_special_tokens is True


def test_a_stream_holds_text_only_while_it_may_start_a_list_of_calls() -> None:
    """Phi-4-mini's calls start with the word `functools[`: a text that starts as that
    word does is held until it leaves it, then streams whole."""
    text = ToolCallText.of(CallReader(PHI4_MINI))
    assert text.feed("fun") == ""
    assert text.feed("ctoo") == ""
    assert text.feed("ls is") == "functools is"
    assert text.feed(" a module.") == " a module."
    calls = ToolCallText.of(CallReader(PHI4_MINI))
    assert calls.feed("functools") == "" and calls.feed('[{"name"') == ""
    assert calls.feed(': "f", "arguments": {}}]') == ""
    assert calls.finish() == ("", [ParsedToolCall("f", "{}")])


def _streamed(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed choice put together: its content, its calls, its finish reason."""
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    deltas = [json.loads(e)["choices"][0] for e in events[:-1]]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d["delta"].get("tool_calls") or []]
    message = {"content": content or None, "tool_calls": calls or None}
    return {"message": message, "finish_reason": deltas[-1]["finish_reason"]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_call_cut_by_max_tokens_comes_back_as_a_call_never_as_markup(
    client: TestClient, tool_choice: Any, stream: bool
) -> None:
    """Every max_tokens from 1 to 40, and the call's own length: no call markup in the
    content; once the call's name is written, the call comes back with the arguments written
    so far and finish_reason "length", until max_tokens lets it finish."""
    body = {**TOOL_CHAT, "tool_choice": tool_choice}
    response = client.post("/v1/chat/completions", json=body).json()
    [call] = response["choices"][0]["message"]["tool_calls"]
    needed = response["usage"]["completion_tokens"]  # the whole call's tokens
    name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
    forms = (json.dumps(arguments), json.dumps(arguments, separators=(",", ":")))
    finished_at = None
    for max_tokens in [*range(1, 41), needed]:
        cut = {**body, "max_tokens": max_tokens}
        choice = _streamed(client, cut) if stream else _choice(client, cut)
        assert choice["message"].get("content") is None, (max_tokens, choice)
        calls = choice["message"].get("tool_calls") or []
        if choice["finish_reason"] == "tool_calls":
            finished_at = finished_at or max_tokens
            assert [c["function"]["name"] for c in calls] == [name]
            assert json.loads(calls[0]["function"]["arguments"]) == arguments
            continue
        assert choice["finish_reason"] == "length", max_tokens
        if calls:
            [partial] = calls
            assert partial["function"]["name"] == name
            written = partial["function"]["arguments"]
            assert any(form.startswith(written) for form in forms), (max_tokens, written)
    assert finished_at == needed  # the smallest max_tokens that completes the call
