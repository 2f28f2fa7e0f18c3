"""Structured outputs through the API (in-process, tiny Llama): response_format json_schema and
json_object, vLLM's guided_* and structured_outputs, streams, and the errors of bad grammars."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from engine import AsyncEngine, EngineConfig, LLMEngine
from gateway.app import create_app
from gateway.config import GatewayConfig

MODEL = "tiny-llama"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "intent": {"enum": ["billing", "refund", "other"]},
        "urgent": {"type": "boolean"},
    },
    "required": ["intent", "urgent"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "ticket", "schema": SCHEMA, "strict": True},
}
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "My card was charged twice."}],
    "temperature": 0,
    "max_tokens": 60,
}
COMPLETION = {"model": MODEL, "prompt": "The answer is", "temperature": 0, "max_tokens": 30}


@pytest.fixture(scope="module")
def client(tiny_llama_path: Path) -> Iterator[TestClient]:
    config = EngineConfig(
        model=str(tiny_llama_path), block_size=4, num_kv_blocks=512, max_model_len=256
    )
    app: Starlette = create_app(
        GatewayConfig(engine=config), engine=AsyncEngine(config, engine=LLMEngine(config))
    )
    with TestClient(app) as test_client:
        yield test_client


def _chat(client: TestClient, **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json={**CHAT, **fields})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _error(client: TestClient, route: str, body: dict[str, Any]) -> tuple[int, Any, Any]:
    response = client.post(route, json=body)
    error = response.json()["error"]
    return response.status_code, error["param"], error["message"]


def test_json_schema_strict_content_validates(client: TestClient) -> None:
    body = _chat(client, response_format=JSON_SCHEMA_FORMAT, n=3, temperature=1.0, seed=5)
    for choice in body["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        assert choice["finish_reason"] == "stop"


def test_the_stream_spells_the_same_json(client: TestClient) -> None:
    content = _chat(client, response_format=JSON_SCHEMA_FORMAT)["choices"][0]["message"]["content"]
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={**CHAT, "response_format": JSON_SCHEMA_FORMAT, "stream": True},
    ) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event)["choices"] for event in events[:-1]]
    streamed = "".join(c[0]["delta"].get("content") or "" for c in chunks if c)
    assert streamed == content
    assert [c[0]["finish_reason"] for c in chunks if c][-1] == "stop"


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"guided_choice": ["yes", "no", "maybe"]}, r"yes|no|maybe"),
        ({"guided_regex": r"[0-9]{2}-[a-z]{3}"}, r"[0-9]{2}-[a-z]{3}"),
        ({"structured_outputs": {"choice": ["red", "green"]}}, r"red|green"),
        ({"structured_outputs": {"regex": r"(ab){1,3}c"}}, r"(ab){1,3}c"),
        ({"guided_grammar": 'start: "on" | "off"'}, r"on|off"),
    ],
)
def test_vllm_extensions_on_both_routes(
    client: TestClient, fields: dict[str, Any], pattern: str
) -> None:
    chat = _chat(client, **fields)["choices"][0]
    assert re.fullmatch(pattern, chat["message"]["content"])
    response = client.post("/v1/completions", json={**COMPLETION, **fields})
    assert response.status_code == 200, response.text
    assert re.fullmatch(pattern, response.json()["choices"][0]["text"])


def test_guided_json_as_an_object_or_as_text(client: TestClient) -> None:
    for schema in (SCHEMA, json.dumps(SCHEMA)):
        content = _chat(client, guided_json=schema)["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(content), SCHEMA)


def test_json_object_starts_an_object_and_text_is_free(client: TestClient) -> None:
    constrained = _chat(client, response_format={"type": "json_object"}, max_tokens=8)
    assert constrained["choices"][0]["message"]["content"].startswith("{")
    text = _chat(client, response_format={"type": "text"}, max_tokens=8)["choices"][0]
    plain = _chat(client, max_tokens=8)["choices"][0]
    assert text["message"]["content"] == plain["message"]["content"]
    assert not plain["message"]["content"].startswith("{")


@pytest.mark.parametrize(
    ("route", "fields", "param", "message"),
    [
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}, "strict": True},
                }
            },
            "response_format",
            "invalid JSON schema: ",
        ),
        ("/v1/chat/completions", {"guided_regex": "a(b"}, "guided_regex", "invalid regex: "),
        ("/v1/completions", {"guided_json": "{oops"}, "guided_json", "invalid JSON schema: "),
        (
            "/v1/completions",
            {"structured_outputs": {"grammar": "start: nothing_here"}},
            "structured_outputs",
            "invalid grammar: ",
        ),
    ],
)
def test_a_grammar_that_cannot_compile_is_400_naming_its_field(
    client: TestClient, route: str, fields: dict[str, Any], param: str, message: str
) -> None:
    base = CHAT if "chat" in route else COMPLETION
    status, got_param, got_message = _error(client, route, {**base, **fields})
    assert (status, got_param) == (400, param)
    assert got_message.startswith(message) and len(got_message) > len(message) + 3


# --- a registry entry's output contract ------------------------------------------------------

CONTRACT_FILE = """\
version: 1
prefixes:
  - name: labels
    text: "Classify the ticket. Label:"
    response_format:
      type: json_schema
      json_schema:
        name: ticket
        schema:
          type: object
          properties: {intent: {enum: [billing, refund, other]}, urgent: {type: boolean}}
          required: [intent, urgent]
          additionalProperties: false
    defaults: {temperature: 0, max_tokens: 40}
"""
LABEL_PROMPT = "Classify the ticket. Label: my card was charged twice"


@pytest.fixture(scope="module")
def contract_client(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    prefixes = tmp_path_factory.mktemp("contract") / "prefixes.yaml"
    prefixes.write_text(CONTRACT_FILE)
    config = EngineConfig(
        model=str(tiny_llama_path),
        block_size=4,
        num_kv_blocks=512,
        max_model_len=256,
        prefix_file=str(prefixes),
    )
    app = create_app(
        GatewayConfig(engine=config), engine=AsyncEngine(config, engine=LLMEngine(config))
    )
    with TestClient(app) as test_client:
        yield test_client


def _complete(client: TestClient, **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"model": MODEL, **fields})
    assert response.status_code == 200, response.text
    choice: dict[str, Any] = response.json()["choices"][0]
    return choice


def test_a_request_that_hits_the_entry_gets_its_contract(contract_client: TestClient) -> None:
    # No temperature, max_tokens or format of its own: the entry's greedy JSON, 40 tokens max.
    hit = _complete(contract_client, prompt=LABEL_PROMPT)
    jsonschema.validate(json.loads(hit["text"]), SCHEMA)
    explicit = _complete(
        contract_client,
        prompt=LABEL_PROMPT,
        temperature=0,
        max_tokens=40,
        guided_json=SCHEMA,
    )
    assert hit["text"] == explicit["text"]


def test_the_requests_own_fields_win(contract_client: TestClient) -> None:
    own = _complete(contract_client, prompt=LABEL_PROMPT, guided_choice=["yes", "no"])
    assert own["text"] in ("yes", "no")
    free = _complete(contract_client, prompt=LABEL_PROMPT, max_tokens=5, ignore_eos=True)
    assert free["finish_reason"] == "length"  # the entry's grammar still applies...
    assert free["text"].startswith("{")  # ...but its max_tokens gave way to the request's


def test_a_prompt_that_misses_the_entry_is_free(contract_client: TestClient) -> None:
    miss = _complete(contract_client, prompt="Something else", max_tokens=6, ignore_eos=True)
    assert miss["finish_reason"] == "length"
    assert not miss["text"].startswith("{")


def test_the_admin_api_shows_the_contract(contract_client: TestClient) -> None:
    [card] = contract_client.get("/v1/prefixes").json()["data"]
    assert card["response_format"]["type"] == "json_schema"
    assert card["response_format"]["json_schema"]["schema"] == SCHEMA
    assert card["defaults"] == {"temperature": 0.0, "max_tokens": 40, "stop": None}
