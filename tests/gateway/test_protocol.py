"""gateway.protocol: every bad field gives its exact OpenAI error body; good bodies become the
exact SamplingParams; responses parse with the official openai SDK types."""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterator
from typing import Any

import openai.types
import openai.types.chat
import pytest
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from engine import SamplingParams
from gateway.admission import parse_model
from gateway.errors import install_error_handlers
from gateway.protocol import (
    ChatCompletionLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatCompletionTokenLogprob,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    TopLogprob,
    UsageInfo,
    api_finish_reason,
    random_id,
)

REQUESTS: dict[str, type[BaseModel]] = {"chat": ChatCompletionRequest, "cmpl": CompletionRequest}


async def _echo(request: Request) -> JSONResponse:
    body = parse_model(await request.body(), REQUESTS[request.path_params["kind"]])
    return JSONResponse(body.model_dump(mode="json"))


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    app = Starlette(routes=[Route("/{kind}", _echo, methods=["POST"])])
    install_error_handlers(app)
    with TestClient(app) as test_client:
        yield test_client


DROP = object()
USER = {"role": "user", "content": "hi"}


def chat(**fields: Any) -> dict[str, Any]:
    body = {"model": "m", "messages": [USER], **fields}
    return {key: value for key, value in body.items() if value is not DROP}


def cmpl(**fields: Any) -> dict[str, Any]:
    body = {"model": "m", "prompt": "hi", **fields}
    return {key: value for key, value in body.items() if value is not DROP}


def msgs(*messages: Any) -> dict[str, Any]:
    return chat(messages=list(messages))


def unsupported_param(param: str) -> tuple[str, str, str]:
    message = f"Unsupported parameter: '{param}' is not supported by this server."
    return param, "unsupported_parameter", message


def bad_type(param: str, expected: str, got: str) -> tuple[str, str, str]:
    message = f"Invalid type for '{param}': expected {expected}, but got {got} instead."
    return param, "invalid_type", message


def bad_value(param: str, detail: str) -> tuple[str, str, str]:
    return param, "invalid_value", f"Invalid value for '{param}': {detail}."


def missing(param: str) -> tuple[str, str, str]:
    return param, "missing_required_parameter", f"Missing required parameter: '{param}'."


NO_TOOLS = (
    "Unsupported value: '{}' must be 'none': the deprecated function calling is not supported "
    "by this server (send 'tools')."
)
PART = (
    "Unsupported value: 'messages[0].content[{}]' has type '{t}'; {t} content parts are not "
    "supported by this server (send 'text' parts only)."
)
PROMPT_SHAPE = (
    "Invalid value for 'prompt': must be a string, an array of strings, an array of token ids "
    "or an array of non-empty arrays of token ids (token ids are non-negative integers)."
)
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
TEXT = {"type": "text", "text": "hi"}

# (id, route, body, (param, code, message))
BAD_BODIES: list[tuple[str, str, dict[str, Any], tuple[str, str, str]]] = [
    ("model-missing", "chat", chat(model=DROP), missing("model")),
    ("model-type", "chat", chat(model=5), bad_type("model", "a string", "an integer")),
    ("messages-missing", "chat", chat(messages=DROP), missing("messages")),
    (
        "messages-empty",
        "chat",
        chat(messages=[]),
        bad_value("messages", "array should have at least 1 item, not 0"),
    ),
    ("messages-type", "chat", chat(messages="hi"), bad_type("messages", "an array", "a string")),
    ("message-type", "chat", msgs(5), bad_type("messages[0]", "an object", "an integer")),
    ("role-missing", "chat", msgs({"content": "hi"}), missing("messages[0].role")),
    (
        "role-unknown",
        "chat",
        msgs({"role": "robot", "content": "hi"}),
        bad_value(
            "messages[0].role",
            "input should be 'system', 'developer', 'user', 'assistant' or 'tool'",
        ),
    ),
    (
        "role-function",
        "chat",
        msgs(USER, {"role": "function", "content": "x"}),
        (
            "messages[1].role",
            "unsupported_value",
            "Unsupported value: 'messages[1].role' is 'function'; the deprecated function "
            "messages are not supported by this server (send 'tool' messages).",
        ),
    ),
    ("content-missing", "chat", msgs({"role": "user"}), missing("messages[0].content")),
    (
        "content-null",
        "chat",
        msgs({"role": "user", "content": None}),
        bad_value("messages[0].content", "must not be null for role 'user'"),
    ),
    (
        "content-type",
        "chat",
        msgs({"role": "user", "content": 5}),
        bad_type(
            "messages[0].content",
            "a string or an array of content parts",
            "an integer",
        ),
    ),
    (
        "part-image",
        "chat",
        msgs({"role": "user", "content": [TEXT, IMAGE]}),
        ("messages[0].content[1]", "unsupported_value", PART.format(1, t="image_url")),
    ),
    (
        "part-audio",
        "chat",
        msgs({"role": "user", "content": [AUDIO]}),
        ("messages[0].content[0]", "unsupported_value", PART.format(0, t="input_audio")),
    ),
    (
        "part-no-text",
        "chat",
        msgs({"role": "user", "content": [{"type": "text"}]}),
        missing("messages[0].content[0].text"),
    ),
    (
        "part-type",
        "chat",
        msgs({"role": "user", "content": ["hi"]}),
        bad_type("messages[0].content[0]", "an object", "a string"),
    ),
    (
        "tool-calls",
        "chat",
        msgs(USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}),
        missing("messages[1].tool_calls[0].type"),
    ),
    (
        "name-type",
        "chat",
        msgs({"role": "user", "content": "hi", "name": 5}),
        bad_type("messages[0].name", "a string", "an integer"),
    ),
    (
        "max-tokens-0",
        "chat",
        chat(max_tokens=0),
        bad_value("max_tokens", "input should be greater than or equal to 1"),
    ),
    (
        "max-tokens-str",
        "chat",
        chat(max_tokens="9"),
        bad_type("max_tokens", "an integer", "a string"),
    ),
    (
        "max-tokens-float",
        "chat",
        chat(max_tokens=1.5),
        bad_type("max_tokens", "an integer", "a decimal"),
    ),
    (
        "max-completion-tokens-0",
        "chat",
        chat(max_completion_tokens=0),
        bad_value("max_completion_tokens", "input should be greater than or equal to 1"),
    ),
    (
        "temperature-high",
        "chat",
        chat(temperature=2.5),
        bad_value("temperature", "input should be less than or equal to 2"),
    ),
    (
        "temperature-negative",
        "chat",
        chat(temperature=-0.1),
        bad_value("temperature", "input should be greater than or equal to 0"),
    ),
    (
        "temperature-str",
        "chat",
        chat(temperature="0.5"),
        bad_type("temperature", "a number", "a string"),
    ),
    (
        "temperature-bool",
        "chat",
        chat(temperature=True),
        bad_type("temperature", "a number", "a boolean"),
    ),
    ("top-p-0", "chat", chat(top_p=0), bad_value("top_p", "input should be greater than 0")),
    (
        "top-p-high",
        "chat",
        chat(top_p=1.5),
        bad_value("top_p", "input should be less than or equal to 1"),
    ),
    (
        "top-k",
        "chat",
        chat(top_k=-2),
        bad_value("top_k", "input should be greater than or equal to -1"),
    ),
    (
        "min-p",
        "chat",
        chat(min_p=1.5),
        bad_value("min_p", "input should be less than or equal to 1"),
    ),
    (
        "seed-int64",
        "chat",
        chat(seed=2**63),
        bad_value("seed", "input should be less than or equal to 9223372036854775807"),
    ),
    (
        "stop-type",
        "chat",
        chat(stop=5),
        bad_type("stop", "a string or an array of strings", "an integer"),
    ),
    (
        "stop-empty-string",
        "chat",
        chat(stop=["a", ""]),
        bad_value("stop[1]", "string should have at least 1 character"),
    ),
    (
        "stop-too-many",
        "chat",
        chat(stop=[str(i) for i in range(17)]),
        bad_value("stop", "array should have at most 16 items, not 17"),
    ),
    ("n-0", "chat", chat(n=0), bad_value("n", "input should be greater than or equal to 1")),
    ("n-17", "chat", chat(n=17), bad_value("n", "input should be less than or equal to 16")),
    (
        "presence-penalty",
        "chat",
        chat(presence_penalty=3),
        bad_value("presence_penalty", "input should be less than or equal to 2"),
    ),
    (
        "frequency-penalty",
        "chat",
        chat(frequency_penalty=-3),
        bad_value("frequency_penalty", "input should be greater than or equal to -2"),
    ),
    (
        "repetition-penalty",
        "chat",
        chat(repetition_penalty=0),
        bad_value("repetition_penalty", "input should be greater than 0"),
    ),
    ("logprobs-type", "chat", chat(logprobs="yes"), bad_type("logprobs", "a boolean", "a string")),
    (
        "top-logprobs-high",
        "chat",
        chat(logprobs=True, top_logprobs=21),
        bad_value("top_logprobs", "input should be less than or equal to 20"),
    ),
    (
        "top-logprobs-without-logprobs",
        "chat",
        chat(top_logprobs=5),
        bad_value("top_logprobs", "only allowed when 'logprobs' is true"),
    ),
    ("stream-type", "chat", chat(stream="yes"), bad_type("stream", "a boolean", "a string")),
    (
        "stream-options-without-stream",
        "chat",
        chat(stream_options={"include_usage": True}),
        bad_value("stream_options", "only allowed when 'stream' is true"),
    ),
    (
        "include-usage-type",
        "chat",
        chat(stream=True, stream_options={"include_usage": "yes"}),
        bad_type("stream_options.include_usage", "a boolean", "a string"),
    ),
    ("tools", "chat", chat(tools=[{"type": "function"}]), missing("tools[0].function")),
    (
        "tool-choice",
        "chat",
        chat(tool_choice="sometimes"),
        bad_value("tool_choice", "input should be 'none', 'auto' or 'required'"),
    ),
    ("functions", "chat", chat(functions=[{"name": "f"}]), unsupported_param("functions")),
    (
        "function-call",
        "chat",
        chat(function_call={"name": "f"}),
        ("function_call", "unsupported_value", NO_TOOLS.format("function_call")),
    ),
    (
        "response-format-unknown-type",
        "chat",
        chat(response_format={"type": "xml"}),
        (
            "response_format.type",
            "invalid_value",
            "Invalid value for 'response_format.type': input should be 'text', 'json_object' or "
            "'json_schema'.",
        ),
    ),
    (
        "response-format-json-schema-missing",
        "chat",
        chat(response_format={"type": "json_schema"}),
        (
            "response_format",
            "invalid_value",
            "Invalid value for 'response_format': 'json_schema' is required when 'type' is "
            "'json_schema'.",
        ),
    ),
    (
        "response-format-bad-name",
        "chat",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "a b"}}),
        (
            "response_format.json_schema.name",
            "invalid_value",
            "Invalid value for 'response_format.json_schema.name': string should match pattern "
            "'^[a-zA-Z0-9_-]{1,64}$'.",
        ),
    ),
    (
        "two-constraints",
        "chat",
        chat(response_format={"type": "json_object"}, guided_regex="a+"),
        (
            None,
            "invalid_value",
            "Invalid value for the request body: one structured output constraint at a time, got "
            "response_format "
            "and guided_regex.",
        ),
    ),
    ("audio", "chat", chat(audio={"voice": "alloy", "format": "wav"}), unsupported_param("audio")),
    (
        "modalities",
        "chat",
        chat(modalities=["text", "audio"]),
        (
            "modalities",
            "unsupported_value",
            "Unsupported value: 'modalities' must be ['text']: other output modalities are not "
            "supported by this server.",
        ),
    ),
    (
        "prediction",
        "chat",
        chat(prediction={"type": "content", "content": "x"}),
        unsupported_param("prediction"),
    ),
    (
        "logit-bias-key",
        "chat",
        chat(logit_bias={"x1": -100}),
        bad_value("logit_bias", "keys must be token ids written as decimal integers"),
    ),
    (
        "logit-bias-key-spelling",  # "05" and "5" would name one token twice
        "chat",
        chat(logit_bias={"05": 1}),
        bad_value("logit_bias", "keys must be token ids written as decimal integers"),
    ),
    (
        "logit-bias-negative-key",
        "chat",
        chat(logit_bias={"-3": 1}),
        bad_value("logit_bias", "keys must be token ids written as decimal integers"),
    ),
    (
        "logit-bias-value",
        "chat",
        chat(logit_bias={"7": 100.5}),
        bad_value("logit_bias.7", "input should be less than or equal to 100"),
    ),
    (
        "logit-bias-value-type",
        "chat",
        chat(logit_bias={"7": "ban"}),
        bad_type("logit_bias.7", "a number", "a string"),
    ),
    (
        "logit-bias-type",
        "chat",
        chat(logit_bias="x"),
        bad_type("logit_bias", "an object", "a string"),
    ),
    ("user-type", "chat", chat(user=5), bad_type("user", "a string", "an integer")),
    (
        "ignore-eos-type",
        "chat",
        chat(ignore_eos="no"),
        bad_type("ignore_eos", "a boolean", "a string"),
    ),
    ("prompt-missing", "cmpl", cmpl(prompt=DROP), missing("prompt")),
    ("prompt-empty", "cmpl", cmpl(prompt=[]), bad_value("prompt", "must not be an empty array")),
    (
        "prompt-type",
        "cmpl",
        cmpl(prompt=5),
        bad_type("prompt", "a string or an array", "an integer"),
    ),
    ("prompt-mixed", "cmpl", cmpl(prompt=[1, "a"]), ("prompt", "invalid_value", PROMPT_SHAPE)),
    ("prompt-empty-ids", "cmpl", cmpl(prompt=[[1], []]), ("prompt", "invalid_value", PROMPT_SHAPE)),
    ("prompt-negative-id", "cmpl", cmpl(prompt=[-1]), ("prompt", "invalid_value", PROMPT_SHAPE)),
    ("prompt-bool-id", "cmpl", cmpl(prompt=[True]), ("prompt", "invalid_value", PROMPT_SHAPE)),
    (
        "zero-tokens-without-echo",
        "cmpl",
        cmpl(max_tokens=0),
        (
            "max_tokens",
            "invalid_value",
            "Invalid value for 'max_tokens': may be 0 only with 'echo': true (to score the "
            "prompt alone).",
        ),
    ),
    (
        "best-of",
        "cmpl",
        cmpl(best_of=2),
        (
            "best_of",
            "unsupported_value",
            "Unsupported value: 'best_of' must equal 'n' (1): a best_of other than n is not "
            "supported by this server.",
        ),
    ),
    (
        "cmpl-logprobs-high",
        "cmpl",
        cmpl(logprobs=21),
        bad_value("logprobs", "input should be less than or equal to 20"),
    ),
    (
        "cmpl-logprobs-bool",
        "cmpl",
        cmpl(logprobs=True),
        bad_type("logprobs", "an integer", "a boolean"),
    ),
    (
        "cmpl-max-tokens-negative",
        "cmpl",
        cmpl(max_tokens=-1),
        bad_value("max_tokens", "input should be greater than or equal to 0"),
    ),
    (
        "cmpl-stream-options",
        "cmpl",
        cmpl(stream=False, stream_options={"include_usage": True}),
        bad_value("stream_options", "only allowed when 'stream' is true"),
    ),
    (
        "cmpl-logit-bias-value",
        "cmpl",
        cmpl(logit_bias={"1": -101}),
        bad_value("logit_bias.1", "input should be greater than or equal to -100"),
    ),
]


@pytest.mark.parametrize(
    ("route", "body", "expected"),
    [pytest.param(route, body, expected, id=name) for name, route, body, expected in BAD_BODIES],
)
def test_bad_body_gives_exact_error(
    client: TestClient, route: str, body: dict[str, Any], expected: tuple[str, str, str]
) -> None:
    param, code, message = expected
    response = client.post(f"/{route}", json=body)
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": code,
        }
    }


def test_bad_body_table_is_big_and_unique() -> None:
    names = [name for name, *_ in BAD_BODIES]
    assert len(names) >= 40
    assert len(set(names)) == len(names)


def test_unknown_fields_are_accepted_and_logged(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    message = {"role": "user", "content": [{**TEXT, "cache_control": {}}], "refusal": None}
    body = chat(messages=[message], prompt_cache_key="k", store=True, metadata={"a": "b"})
    with caplog.at_level(logging.DEBUG, logger="gateway.protocol.common"):
        response = client.post("/chat", json=body)
    assert response.status_code == 200
    assert [r.getMessage() for r in caplog.records if r.name == "gateway.protocol.common"] == [
        "ignoring unknown fields of TextContentPart: ['cache_control']",
        "ignoring unknown fields of ChatMessage: ['refusal']",
        "ignoring unknown fields of ChatCompletionRequest: ['metadata', 'store']",
    ]
    assert all(r.levelno == logging.DEBUG for r in caplog.records)


def test_nulls_mean_defaults(client: TestClient) -> None:
    body = chat(n=None, stream=None, logprobs=None, stop=None, temperature=None, tools=None)
    request = ChatCompletionRequest.model_validate(body)
    assert (request.n, request.stream, request.logprobs) == (1, False, False)
    assert client.post("/chat", json=body).status_code == 200
    assert client.post("/cmpl", json=cmpl(echo=None, suffix=None, best_of=1)).status_code == 200


def test_features_in_their_off_form_are_accepted() -> None:
    body = chat(
        tools=[],
        tool_choice="none",
        functions=[],
        response_format={"type": "text"},
        modalities=["text"],
        logit_bias={},
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        top_logprobs=0,
    )
    request = ChatCompletionRequest.model_validate(body)
    assert request.include_usage


DEFAULT = SamplingParams(max_tokens=None)


@pytest.mark.parametrize(
    ("body", "default_max_tokens", "expected"),
    [
        pytest.param(chat(), None, DEFAULT, id="defaults"),
        pytest.param(chat(), 64, SamplingParams(max_tokens=64), id="server-default"),
        pytest.param(chat(max_tokens=5), 64, SamplingParams(max_tokens=5), id="max-tokens"),
        pytest.param(
            chat(max_tokens=5, max_completion_tokens=7),
            None,
            SamplingParams(max_tokens=7),
            id="max-completion-tokens-wins",
        ),
        pytest.param(
            chat(logprobs=True), None, SamplingParams(max_tokens=None, logprobs=0), id="logprobs"
        ),
        pytest.param(chat(stop="x"), None, SamplingParams(max_tokens=None, stop=("x",)), id="stop"),
        pytest.param(
            chat(
                max_completion_tokens=9,
                temperature=0,
                top_p=0.5,
                top_k=-1,
                min_p=0.1,
                seed=-(2**63),
                stop=["a", "b"],
                presence_penalty=-2,
                frequency_penalty=2,
                repetition_penalty=1.1,
                logprobs=True,
                top_logprobs=20,
                ignore_eos=True,
                skip_special_tokens=False,
                speculative=False,
                n=3,
                user="u",
                logit_bias={"7": -100, "12": 2.5},
            ),
            None,
            SamplingParams(
                max_tokens=9,
                temperature=0.0,
                top_p=0.5,
                top_k=-1,
                min_p=0.1,
                seed=-(2**63),
                stop=("a", "b"),
                ignore_eos=True,
                presence_penalty=-2.0,
                frequency_penalty=2.0,
                repetition_penalty=1.1,
                logprobs=20,
                skip_special_tokens=False,
                speculative=False,
                logit_bias=((7, -100.0), (12, 2.5)),
            ),
            id="everything",
        ),
        pytest.param(cmpl(), None, SamplingParams(max_tokens=16), id="cmpl-defaults"),
        pytest.param(cmpl(max_tokens=None), None, SamplingParams(max_tokens=16), id="cmpl-null"),
        pytest.param(
            cmpl(logprobs=3, temperature=0.7, top_k=40, seed=1, logit_bias={"0": 100}),
            None,
            SamplingParams(
                max_tokens=16,
                logprobs=3,
                temperature=0.7,
                top_k=40,
                seed=1,
                logit_bias=((0, 100.0),),
            ),
            id="cmpl-sampling",
        ),
    ],
)
def test_to_sampling_params(
    body: dict[str, Any], default_max_tokens: int | None, expected: SamplingParams
) -> None:
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    request = model.model_validate(body)
    if isinstance(request, CompletionRequest):
        assert request.to_sampling_params() == expected
    else:
        assert isinstance(request, ChatCompletionRequest)
        assert request.to_sampling_params(default_max_tokens) == expected


def test_flat_messages_joins_text_parts() -> None:
    request = ChatCompletionRequest.model_validate(
        msgs(
            {"role": "developer", "content": "be brief"},
            {"role": "system", "content": ""},
            {"role": "user", "content": [{"type": "text", "text": "Hel"}, TEXT], "name": "x"},
            {"role": "assistant", "content": None},
        )
    )
    assert request.flat_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": ""},
        {"role": "user", "content": "Helhi"},
        {"role": "assistant", "content": ""},
    ]


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2], [[1, 2]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_prompts_are_normalised(prompt: Any, expected: list[Any]) -> None:
    assert CompletionRequest.model_validate(cmpl(prompt=prompt)).prompts() == expected


def test_request_schema_shows_the_accepted_shapes() -> None:
    schema = ChatCompletionRequest.model_json_schema()
    content = schema["$defs"]["ChatMessage"]["properties"]["content"]
    assert [option.get("type") for option in content["anyOf"]] == ["string", "array", "null"]
    assert schema["additionalProperties"] is True


def test_random_id() -> None:
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{24}", random_id("chatcmpl"))
    assert re.fullmatch(
        r"cmpl-[0-9a-f]{24}", CompletionResponse(model="m", choices=[], usage=UsageInfo()).id
    )
    assert random_id("cmpl") != random_id("cmpl")


@pytest.mark.parametrize(
    ("reason", "expected"),
    [(None, None), ("stop", "stop"), ("length", "length"), ("abort", "stop")],
)
def test_api_finish_reason(reason: str | None, expected: str | None) -> None:
    assert api_finish_reason(reason) == expected


# -- responses -------------------------------------------------------------------------------

USAGE = UsageInfo.from_counts(num_prompt_tokens=10, num_completion_tokens=2, num_cached_tokens=8)
TOKEN_LOGPROB = ChatCompletionTokenLogprob(
    token="Hi",
    logprob=-0.25,
    bytes=[72, 105],
    top_logprobs=[
        TopLogprob(token="Hi", logprob=-0.25, bytes=[72, 105]),
        TopLogprob(token="Yo", logprob=-math.inf, bytes=[89, 111]),
    ],
)


def as_json(model: BaseModel) -> Any:
    return json.loads(model.model_dump_json())


def test_chat_completion_parses_with_the_sdk() -> None:
    response = ChatCompletionResponse(
        model="m",
        choices=[
            ChatCompletionResponseChoice(
                index=0,
                message=ChatMessageOut(content="Hi"),
                finish_reason="stop",
                logprobs=ChatCompletionLogprobs(content=[TOKEN_LOGPROB]),
            )
        ],
        usage=USAGE,
    )
    data = as_json(response)
    assert data["choices"][0]["message"] == {"role": "assistant", "content": "Hi"}
    assert data["system_fingerprint"] is None
    parsed = openai.types.chat.ChatCompletion.model_validate(data)
    assert parsed.usage is not None and parsed.usage.total_tokens == 12
    assert parsed.usage.prompt_tokens_details is not None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 8
    logprobs = parsed.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [t.logprob for t in logprobs.content[0].top_logprobs] == [-0.25, -9999.0]


def test_chat_chunks_parse_with_the_sdk() -> None:
    def chunk(delta: DeltaMessage, finish_reason: str | None = None) -> Any:
        choice = ChatCompletionStreamChoice(
            index=0, delta=delta, finish_reason=api_finish_reason(finish_reason)
        )
        return as_json(ChatCompletionStreamResponse(id="c", created=1, model="m", choices=[choice]))

    chunks = [
        chunk(DeltaMessage(role="assistant", content="")),
        chunk(DeltaMessage(content="Hi")),
        chunk(DeltaMessage(), "length"),
        as_json(
            ChatCompletionStreamResponse(id="c", created=1, model="m", choices=[], usage=USAGE)
        ),
    ]
    assert [c["choices"][0]["delta"] for c in chunks[:3]] == [
        {"role": "assistant", "content": ""},
        {"content": "Hi"},
        {},
    ]
    assert chunks[1] == {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "delta": {"content": "Hi"}, "finish_reason": None, "logprobs": None}
        ],
        "usage": None,
        "system_fingerprint": None,
    }
    parsed = [openai.types.chat.ChatCompletionChunk.model_validate(c) for c in chunks]
    assert parsed[2].choices[0].finish_reason == "length"
    assert parsed[3].usage is not None and parsed[3].usage.completion_tokens == 2


def test_completion_parses_with_the_sdk() -> None:
    logprobs = CompletionLogprobs(
        tokens=["a", "b"],
        token_logprobs=[-0.5, -math.inf],
        top_logprobs=[{"a": -0.5}, {"b": -math.inf, "c": -3.0}],
        text_offset=[0, 1],
    )
    response = CompletionResponse(
        model="m",
        choices=[CompletionChoice(index=0, text="ab", finish_reason="length", logprobs=logprobs)],
        usage=USAGE,
    )
    parsed = openai.types.Completion.model_validate(as_json(response))
    assert parsed.choices[0].logprobs is not None
    assert parsed.choices[0].logprobs.token_logprobs == [-0.5, -9999.0]
    assert parsed.choices[0].logprobs.top_logprobs == [{"a": -0.5}, {"b": -9999.0, "c": -3.0}]
    last = CompletionStreamResponse(
        id="cmpl-1",
        model="m",
        choices=[CompletionStreamChoice(index=0, text="", finish_reason="stop")],
        usage=USAGE,
    )
    assert openai.types.Completion.model_validate(as_json(last)).choices[0].finish_reason == "stop"
    running = CompletionStreamChoice(index=0, text="a")
    assert as_json(running) == {"index": 0, "text": "a", "finish_reason": None, "logprobs": None}


def test_models_parse_with_the_sdk() -> None:
    models = ModelList(data=[ModelCard(id="m", created=5, max_model_len=2048)])
    data = as_json(models)
    assert data == {
        "object": "list",
        "data": [
            {
                "id": "m",
                "object": "model",
                "created": 5,
                "owned_by": "prefixgate",
                "max_model_len": 2048,
            }
        ],
    }
    assert openai.types.Model.model_validate(data["data"][0]).owned_by == "prefixgate"
