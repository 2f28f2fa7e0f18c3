"""Client libraries against a real `prefixgate serve` on the default model: the openai SDK's
Responses API (plain, parsed, streamed, tools over chained turns, a registry hit), pydantic-ai,
the OpenAI Agents SDK (through Chat Completions and through Responses) and LiteLLM. Every
structured result is validated by its own pydantic model.

The agent runs offer their tool until it has been called once (pydantic-ai's `prepare`, the
Agents SDK's `is_enabled`): the tool call, its result and the structured answer after it are
the protocol under test, and a 135M model left with the tool would call it again and again.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import openai
import pytest
import yaml
from pydantic import BaseModel, Field

from tests.e2e.conftest import (
    CHAT_WEATHER_TOOL,
    RESPONSES_WEATHER_TOOL,
    SHIPPED_PREFIXES,
    model_of,
)
from tests.gateway.server_harness import Server

pytestmark = pytest.mark.e2e

INSTRUCTIONS = "Use get_weather to look up the weather, then report it."
QUESTION = "What is the weather in Paris?"
# No near-tie on the way to "Paris" (tests/e2e/test_smollm2_server.py says why).
CAPITAL_QUESTION = "What is the capital of France? Answer in one sentence."
T = TypeVar("T")


class Weather(BaseModel):
    city: str = Field(max_length=30)
    temperature_c: int = Field(ge=-50, le=60)


class Pet(BaseModel):
    species: str = Field(max_length=12)
    age: int = Field(ge=0, le=30)


def _run_with_client(server: Server, run: Callable[[openai.AsyncOpenAI], Awaitable[T]]) -> T:
    """`run(client)` in one event loop that closes the client it lent: the agent frameworks'
    own `run_sync` helpers leave connections to be collected in a later loop."""

    async def main() -> T:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused") as client:
            return await run(client)

    return asyncio.run(main())


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"{city}: 18 C, sunny"


WEATHER_TOOL = RESPONSES_WEATHER_TOOL


# -- the openai SDK's Responses API -------------------------------------------------------------


def test_responses_create_and_parse(sdk: openai.OpenAI) -> None:
    model = model_of(sdk)
    response = sdk.responses.create(
        model=model, input=CAPITAL_QUESTION, temperature=0, max_output_tokens=30
    )
    assert response.status in ("completed", "incomplete")
    assert "Paris" in response.output_text
    parsed = sdk.responses.parse(
        model=model,
        input="Invent a pet.",
        text_format=Pet,
        temperature=0,
        max_output_tokens=100,
    )
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, Pet)


def test_responses_stream(sdk: openai.OpenAI) -> None:
    with sdk.responses.stream(
        model=model_of(sdk), input="Invent a pet.", text_format=Pet, temperature=0,
        max_output_tokens=100,
    ) as stream:  # fmt: skip
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert deltas and "".join(deltas) == final.output_text
    assert isinstance(final.output_parsed, Pet)
    assert final.usage is not None and final.usage.output_tokens > 0


def test_responses_tool_round_trip_over_chained_turns(sdk: openai.OpenAI) -> None:
    model = model_of(sdk)
    first = sdk.responses.create(
        model=model,
        input=QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
    )
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city"}
    second = sdk.responses.create(
        model=model,
        previous_response_id=first.id,
        input=[
            {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": get_weather(json.loads(call.arguments)["city"]),
            }
        ],
        tools=[WEATHER_TOOL],
        tool_choice="none",
        temperature=0,
        max_output_tokens=40,
    )
    assert second.previous_response_id == first.id
    assert second.output_text
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert sdk.responses.retrieve(second.id).output_text == second.output_text


def test_responses_hit_the_registry_and_its_contract(sdk: openai.OpenAI) -> None:
    """The intent entry's messages as input items: the registered prefix is reused (cached
    tokens in the Responses usage) and its declared label schema shapes the answer."""
    spec = yaml.safe_load(SHIPPED_PREFIXES.read_text())
    [entry] = [p for p in spec["prefixes"] if p["name"] == "intent-classifier"]
    items = [*entry["messages"], {"role": "user", "content": "Please refund my last bill."}]
    response = sdk.responses.create(model=model_of(sdk), input=items)
    assert response.usage is not None
    assert response.usage.input_tokens_details.cached_tokens > 800
    labels = entry["response_format"]["json_schema"]["schema"]["properties"]["intent"]["enum"]
    assert json.loads(response.output_text)["intent"] in labels


# -- pydantic-ai ----------------------------------------------------------------------------------


def test_pydantic_ai_run_with_a_tool_and_a_structured_result(real_server: Server) -> None:
    from pydantic_ai import Agent, NativeOutput, RunContext, Tool
    from pydantic_ai.messages import ToolReturnPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.tools import ToolDefinition

    calls: list[str] = []

    def weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return get_weather(city)

    async def until_used(ctx: RunContext[None], tool: ToolDefinition) -> ToolDefinition | None:
        used = any(isinstance(p, ToolReturnPart) for m in ctx.messages for p in m.parts)
        return None if used else tool

    with openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="unused") as client:
        name = model_of(client)

    async def run(client: openai.AsyncOpenAI) -> Weather:
        agent = Agent(
            OpenAIChatModel(name, provider=OpenAIProvider(openai_client=client)),
            output_type=NativeOutput(Weather),
            tools=[Tool(weather, name="get_weather", prepare=until_used)],
            instructions=INSTRUCTIONS,
            model_settings={"temperature": 0, "max_tokens": 200, "parallel_tool_calls": False},
        )
        return (await agent.run(QUESTION)).output

    output = _run_with_client(real_server, run)
    assert calls == ["Paris"]
    assert isinstance(output, Weather) and output.city == "Paris"


# -- the OpenAI Agents SDK ------------------------------------------------------------------------


@pytest.fixture
def agents_sdk() -> Iterator[Any]:
    import agents

    agents.set_tracing_disabled(True)  # traces would be sent to OpenAI
    yield agents


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_agents_sdk_run_with_a_tool_and_an_output_type(
    real_server: Server, agents_sdk: Any, api: str
) -> None:
    calls: list[str] = []

    @agents_sdk.function_tool(is_enabled=lambda ctx, agent: not calls)
    def get_weather_tool(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return get_weather(city)

    with openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="unused") as sync_client:
        name = model_of(sync_client)
    model_type = (
        agents_sdk.OpenAIResponsesModel
        if api == "responses"
        else agents_sdk.OpenAIChatCompletionsModel
    )

    async def run(client: openai.AsyncOpenAI) -> Any:
        agent = agents_sdk.Agent(
            name="weather",
            instructions=INSTRUCTIONS,
            tools=[get_weather_tool],
            output_type=Weather,
            model=model_type(name, client),
            model_settings=agents_sdk.ModelSettings(
                temperature=0, max_tokens=200, parallel_tool_calls=False
            ),
        )
        return (await agents_sdk.Runner.run(agent, QUESTION, max_turns=4)).final_output

    output = _run_with_client(real_server, run)
    assert calls == ["Paris"]
    assert isinstance(output, Weather) and output.city == "Paris"


# -- LiteLLM --------------------------------------------------------------------------------------


@pytest.fixture
def litellm(real_server: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    # Its model price map would be fetched from GitHub on import: use the packaged copy.
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm as module

    yield module


def _litellm_target(server: Server) -> dict[str, Any]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused") as client:
        model = model_of(client)
    return {"model": f"openai/{model}", "api_base": f"{server.url}/v1", "api_key": "unused"}


def test_litellm_structured_output_and_tools(litellm: Any, real_server: Server) -> None:
    target = _litellm_target(real_server)
    reply = litellm.completion(
        messages=[{"role": "user", "content": "Invent a pet."}],
        response_format=Pet,
        temperature=0,
        max_tokens=100,
        **target,
    )
    Pet.model_validate_json(reply.choices[0].message.content)
    chat_tool = CHAT_WEATHER_TOOL
    called = litellm.completion(
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[chat_tool],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        **target,
    )
    assert called.choices[0].finish_reason == "tool_calls"
    [call] = called.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}


def test_litellm_responses(litellm: Any, real_server: Server) -> None:
    response = litellm.responses(
        input=CAPITAL_QUESTION,
        temperature=0,
        max_output_tokens=30,
        **_litellm_target(real_server),
    )
    assert "Paris" in response.output[0].content[0].text
