"""A real `prefixgate serve` on the default model with the shipped prefixes.yaml, driven by the
official openai SDK: registry hits, structured outputs (`parse` with pydantic models, strict
JSON schemas, streams) and the intent-classifier entry's declared output contract."""

from __future__ import annotations

import json
from typing import Any, Literal, get_args

import openai
import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field

from engine.loading.source import ModelSource
from tests.e2e.conftest import CHAT_WEATHER_TOOL, SHIPPED_PREFIXES, model_of
from tests.gateway.server_harness import REAL_READY_TIMEOUT, Server, ServerFactory

pytestmark = pytest.mark.e2e

CUSTOMER = "I was billed twice this month, please refund me."
# "Answer in one sentence." keeps greedy decoding off near-ties: the bare question's first
# token is a 0.04-0.08 nat tie ("The" / "L") that quantized AVX2 and AVX-512 kernels break
# differently; with it every token up to "Paris" leads by >= 1.4 nats in both.
QUESTION = "What is the capital of France? Answer in one sentence."


class Intent(BaseModel):
    intent: Literal[
        "account_access",
        "password_reset",
        "billing_question",
        "refund_request",
        "cancel_subscription",
        "change_plan",
        "storage_full",
        "sync_problem",
        "file_recovery",
        "sharing_permissions",
        "security_concern",
        "data_export",
        "app_installation",
        "performance",
        "feature_request",
        "complaint",
        "human_agent",
        "other",
    ]


LABELS = get_args(Intent.model_fields["intent"].annotation)


# Closed objects (additionalProperties: false), as OpenAI requires of a strict schema and as
# the SDK's `parse` sends one: an open schema lets greedy decoding wander into extra keys with
# unbounded strings (seen: 2,400 characters of an invented "image_..." field at max_tokens).
class Pet(BaseModel):
    model_config = ConfigDict(extra="forbid")

    species: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    pets: list[Pet] = Field(max_length=2)


@pytest.fixture(scope="module")
def real_server_no_cache(servers: ServerFactory, smollm2_source: ModelSource) -> Server:
    return servers(
        "--prefixes",
        str(SHIPPED_PREFIXES),
        "--no-prefix-cache",
        ready_timeout=REAL_READY_TIMEOUT,
        name="real-no-cache",
    )


def _intent_messages(customer: str = CUSTOMER) -> list[Any]:
    spec = yaml.safe_load(SHIPPED_PREFIXES.read_text())
    [entry] = [p for p in spec["prefixes"] if p["name"] == "intent-classifier"]
    return [*entry["messages"], {"role": "user", "content": customer}]


def _prefix_tokens(server: Server, name: str) -> int:
    [tokens] = [p["tokens"] for p in server.get_json("/v1/prefixes")["data"] if p["name"] == name]
    assert isinstance(tokens, int)
    return tokens


def _intent_request(server: Server) -> tuple[str, int, int]:
    with openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        completion = client.chat.completions.create(
            model=model_of(client), messages=_intent_messages(), temperature=0, max_tokens=16
        )
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    content = completion.choices[0].message.content
    assert content is not None
    return content, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0


def test_registry_hit_and_no_prefix_cache(
    real_server: Server, real_server_no_cache: Server
) -> None:
    prefix_tokens = _prefix_tokens(real_server, "intent-classifier")
    assert prefix_tokens > 0
    content, num_prompt, cached = _intent_request(real_server)
    assert cached == prefix_tokens
    plain_content, plain_num_prompt, plain_cached = _intent_request(real_server_no_cache)
    assert plain_cached == 0
    assert (plain_content, plain_num_prompt) == (content, num_prompt)
    assert content


def test_knows_the_capital_of_france(sdk: openai.OpenAI) -> None:
    completion = sdk.chat.completions.create(
        model=model_of(sdk),
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=32,
    )
    content = completion.choices[0].message.content
    assert content is not None and "Paris" in content


def test_the_intent_entry_answers_one_label_as_json_by_default(
    sdk: openai.OpenAI, real_server: Server
) -> None:
    """No response_format, no max_tokens, no temperature: the entry's contract applies, and
    the tokens it forces (`{"intent": "`, a label's tail, `"}`) take no step of their own."""
    forced_before = real_server.metrics()["prefixgate_forced_tokens_total"]
    # Without drafts: after earlier intent answers, kept drafts would cover positions the
    # grammar forces (no step of their own either), and this counts fast-forward's alone
    completion = sdk.chat.completions.create(
        model=model_of(sdk), messages=_intent_messages(), extra_body={"speculative": False}
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content is not None
    answer = json.loads(choice.message.content)
    assert list(answer) == ["intent"] and answer["intent"] in LABELS
    assert completion.usage is not None and completion.usage.completion_tokens <= 24
    forced = real_server.metrics()["prefixgate_forced_tokens_total"] - forced_before
    assert forced >= completion.usage.completion_tokens // 2


def test_parse_with_a_pydanticmodel_of(sdk: openai.OpenAI, real_server: Server) -> None:
    completion = sdk.chat.completions.parse(
        model=model_of(sdk),
        messages=_intent_messages("The app crashes every time I open my photos."),
        response_format=Intent,
        temperature=0,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Intent)
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == _prefix_tokens(
        real_server, "intent-classifier"
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_a_nested_strict_schema(sdk: openai.OpenAI, temperature: float) -> None:
    completion = sdk.chat.completions.parse(
        model=model_of(sdk),
        messages=[{"role": "user", "content": "Invent a person who has one pet."}],
        response_format=Person,
        temperature=temperature,
        seed=7,
        max_tokens=200,
    )
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(completion.choices[0].message.parsed, Person)


def test_a_stream_spells_the_same_json(sdk: openai.OpenAI) -> None:
    schema_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": Person.model_json_schema(), "strict": True},
    }
    messages: Any = [{"role": "user", "content": "Invent a person."}]
    whole = sdk.chat.completions.create(
        model=model_of(sdk),
        messages=messages,
        response_format=schema_format,
        temperature=0,
        max_tokens=200,
    )
    stream = sdk.chat.completions.create(
        model=model_of(sdk),
        messages=messages,
        response_format=schema_format,
        temperature=0,
        max_tokens=200,
        stream=True,
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == whole.choices[0].message.content
    Person.model_validate_json(streamed)


def test_a_schema_that_cannot_compile_is_a_bad_request(sdk: openai.OpenAI) -> None:
    bad: Any = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "strin"}, "strict": True},
    }
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.chat.completions.create(
            model=model_of(sdk), messages=[{"role": "user", "content": "hi"}], response_format=bad
        )
    assert raised.value.param == "response_format"
    assert "invalid JSON schema" in raised.value.message


# -- client libraries built on the openai SDK ---------------------------------------------------


def _langchain(server: Server, sdk: openai.OpenAI, **settings: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=model_of(sdk),
        base_url=f"{server.url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        temperature=0,
        max_retries=0,
        **settings,
    )


def test_langchain_with_structured_output(real_server: Server, sdk: openai.OpenAI) -> None:
    chat = _langchain(real_server, sdk)
    structured = chat.with_structured_output(Person, method="json_schema", strict=True)
    person = structured.invoke("Invent a person who has one pet.")
    assert isinstance(person, Person)
    intent = chat.with_structured_output(Intent, method="json_schema").invoke(
        _intent_messages("I forgot my password and the reset email never came.")
    )
    assert isinstance(intent, Intent)


def test_langchain_function_calling_within_a_small_max_tokens(
    real_server: Server, sdk: openai.OpenAI
) -> None:
    """`method="function_calling"` forces a named call. With max_tokens 16 the call's markup
    (~13 tokens) used to take the budget and LangChain got no call (None); the markup is the
    prompt's now, and 16 tokens hold the arguments."""

    class GetWeather(BaseModel):
        """The weather in a city."""

        model_config = ConfigDict(extra="forbid")
        city: str = Field(max_length=20)

    chat = _langchain(real_server, sdk, max_tokens=16)
    weather = chat.with_structured_output(GetWeather, method="function_calling").invoke(
        "What is the weather in Paris?"
    )
    assert isinstance(weather, GetWeather) and weather.city


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_returns_validated_models(sdk: openai.OpenAI, mode: str) -> None:
    """instructor's JSON_SCHEMA mode (response_format json_schema) and TOOLS mode (a forced
    tool call). Its JSON mode asks for any JSON object (json_object) with the schema only in
    the prompt: the grammar keeps the output an object, but this 135M model does not close
    it within 200 tokens."""
    import instructor

    client = instructor.from_openai(sdk, mode=getattr(instructor.Mode, mode))
    person = client.chat.completions.create(
        model=model_of(sdk),
        response_model=Person,
        messages=[{"role": "user", "content": "Invent a person who has one pet."}],
        temperature=0,
        max_tokens=200,
        max_retries=0,
    )
    assert isinstance(person, Person)


# -- tool calling ------------------------------------------------------------------------------

WEATHER_TOOL = CHAT_WEATHER_TOOL


def test_sdk_tool_call_round_trip(sdk: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = sdk.chat.completions.create(
        model=model_of(sdk),
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"  # type: ignore[union-attr]
    assert set(json.loads(call.function.arguments)) == {"city"}  # type: ignore[union-attr]
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"},
    ]
    second = sdk.chat.completions.create(  # sampled: bounded, or its length is chance's
        model=model_of(sdk),
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="none",
        max_tokens=64,
    )
    answer = second.choices[0].message
    assert answer.tool_calls is None and answer.content


def test_sdk_streams_a_tool_call(sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(
        model=model_of(sdk),
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert [call.function.name for call in calls] == ["get_weather"]  # type: ignore[union-attr]
    json.loads(calls[0].function.arguments or "")  # type: ignore[union-attr]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_langchain_bind_tools(real_server: Server, sdk: openai.OpenAI) -> None:
    chat = _langchain(real_server, sdk)
    reply = chat.bind_tools([WEATHER_TOOL], tool_choice="get_weather").invoke("Weather in Rome?")
    [call] = reply.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"}


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_a_call_cut_by_max_tokens_is_a_call_not_markup(
    sdk: openai.OpenAI, tool_choice: Any
) -> None:
    """max_tokens 1 to 40 on the real model: never `<tool_call>` markup in the content; a
    cut call comes back as a tool call with the arguments written so far. The call's opening
    the grammar forces is the prompt's (no step, no share of max_tokens): a named call's
    tokens are its arguments alone (the smallest max_tokens that completes `{"city":
    "Paris"}` went from 27 to 5), a `required` one's start at the function's name (27 to
    18)."""
    request: Any = {
        "model": model_of(sdk),
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "temperature": 0,
    }
    reply = sdk.chat.completions.create(**request, logprobs=True)
    whole = reply.choices[0]
    [call] = whole.message.tool_calls or []
    arguments = call.function.arguments  # type: ignore[union-attr]
    assert whole.logprobs is not None and whole.logprobs.content is not None
    written = "".join(token.token for token in whole.logprobs.content)
    assert reply.usage is not None and reply.usage.completion_tokens == len(whole.logprobs.content)
    if tool_choice == "required":
        assert written.startswith('get_weather","arguments":{')
    else:
        assert written == json.dumps(json.loads(arguments), separators=(",", ":"))
    completes = None
    for max_tokens in range(1, 41):
        choice = sdk.chat.completions.create(**request, max_tokens=max_tokens).choices[0]
        assert not choice.message.content, (max_tokens, choice.message.content)
        calls = choice.message.tool_calls or []
        if choice.finish_reason == "tool_calls":
            completes = completes or max_tokens
            assert [c.function.arguments for c in calls] == [arguments]  # type: ignore[union-attr]
            continue
        assert choice.finish_reason == "length"
        for cut in calls:
            assert cut.function.name == "get_weather"  # type: ignore[union-attr]
            written = cut.function.arguments.replace(" ", "")  # type: ignore[union-attr]
            assert arguments.replace(" ", "").startswith(written), (max_tokens, written)
    assert completes == reply.usage.completion_tokens  # the call fits in 40 tokens
