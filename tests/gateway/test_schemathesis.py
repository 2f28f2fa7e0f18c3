"""Schemathesis over the live server's own /openapi.json: schema-valid requests (positive) and
schema-invalid ones (negative) against every operation of a real uvicorn serving the tiny
Llama with an API key and an admin key, with every check Schemathesis has.

Three rules no JSON schema can state are named here, and only for them a schema-valid request
may get a 400, with exactly that error code:
- `context_length_exceeded`: prompt tokens + max_tokens must fit the model's context;
- the completions `best_of` must equal `n` (and `stream_options` needs `stream`,
  `top_logprobs` needs `logprobs`): cross-field rules, code `unsupported_value` /
  `invalid_value` on exactly those fields;
- `too_many_sequences`: n x prompts must fit the waiting queue;
- a completions `max_tokens` of 0 needs `echo` (`invalid_value` on max_tokens), and `suffix`
  needs a model with a fill-in-the-middle format and no `echo` (`unsupported_value`; the tiny
  model has none);
- `tool_choice` `required` or a named function needs `tools` holding it (`invalid_value`);
- a tool result answers a call made before it (`messages[i].tool_call_id`, and the Responses
  `input[i].call_id`: `invalid_value`);
- a structured output constraint (`response_format`, `tools`, `guided_*`,
  `structured_outputs`) must be a grammar llguidance can compile (`invalid_value` on that
  field; with tools, the tool's `parameters` that do not compile on their own), and a
  request sets at most one of them (`invalid_value`, no field, the message
  says so).
The Responses API states its rules on the same fields: `input` must fit the context,
`text.format` must compile (with `tools` beside it, the one grammar is named `tools`).
More depend on the server's state, not on the request's shape: token ids must be below the
vocabulary size (`invalid_token_id`: a prompt's, a `logit_bias` key's, /detokenize's), an
unknown `model` is a 404 `model_not_found`, and a response id that is not kept
(`previous_response_id`, or the id in /v1/responses/{id}) is a 404 `response_not_found` (as
Schemathesis itself accepts for schema-valid data: a resource that does not exist).
Everything else must hold as Schemathesis states it: no 5xx, every error OpenAI-shaped,
schema-valid requests accepted, schema-invalid ones rejected, statuses, content types and
bodies as documented.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from tests.gateway.server_harness import Server, ServerFactory

pytestmark = pytest.mark.slow

API_KEY, ADMIN_KEY = "sk-test", "sk-admin"
MAX_EXAMPLES = 50
MIN_EXAMPLES = 20
SERVER_ARGS = (
    *(
        "--dtype",
        "float32",
        "--block-size",
        "4",
        "--num-kv-blocks",
        "1024",
        "--max-model-len",
        "512",
    ),
    *("--admin-api-key", ADMIN_KEY, "--max-waiting", "64"),
)
# (field, code) of the cross-field rules the module docstring lists.
CROSS_FIELD_RULES = {
    (None, "context_length_exceeded"),
    ("max_tokens", "context_length_exceeded"),
    ("messages", "context_length_exceeded"),
    ("prompt", "context_length_exceeded"),
    ("best_of", "unsupported_value"),
    ("stream_options", "invalid_value"),
    ("top_logprobs", "invalid_value"),
    ("n", "too_many_sequences"),
    ("model", "model_not_found"),
    ("prompt", "invalid_token_id"),
    ("logit_bias", "invalid_token_id"),
    ("tokens", "invalid_token_id"),
    ("max_tokens", "invalid_value"),
    ("suffix", "unsupported_value"),
    ("input", "context_length_exceeded"),
    ("previous_response_id", "response_not_found"),
    ("id", "response_not_found"),
    ("messages[].tool_call_id", "invalid_value"),
    ("input[].call_id", "invalid_value"),
    ("tools[].function.parameters", "invalid_value"),
    ("tools[].parameters", "invalid_value"),
    *(
        (field, "invalid_value")
        for field in (
            "response_format",
            "text.format",
            "tools",
            "tool_choice",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "structured_outputs",
        )
    ),
}
ONE_CONSTRAINT = "one structured output constraint at a time"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
    ignored_auth,
    unsupported_method,
]


PREFIXES = """\
version: 1
prefixes:
  - name: helper
    messages:
      - role: system
        content: You are a helpful assistant. Answer the question briefly and politely.
"""


@pytest.fixture(scope="module")
def server(server_logs: Path, tiny_llama_path: Path) -> Iterator[Server]:
    prefixes = server_logs / "prefixes.yaml"
    prefixes.write_text(PREFIXES)
    factory = ServerFactory(server_logs)
    args = ("--model", str(tiny_llama_path), *SERVER_ARGS, "--prefixes", str(prefixes))
    yield factory(*args, api_key=API_KEY, name="fuzz")
    factory.close()


@pytest.fixture(scope="module")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("schemathesis-logs")


def _operations(server: Server) -> list[Any]:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    # The admin key may call every route; as configured auth, Schemathesis knows it is valid
    # and its ignored_auth check probes each secured route without it and with a wrong one.
    schema.config.update(headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    return [result.ok() for result in schema.get_all_operations()]


def _accepted_or_cross_field(case: Any, response: Any) -> None:
    """positive_data_acceptance, minus the named cross-field rules."""
    if response.status_code < 400:
        return
    error = json.loads(response.content)["error"]
    if error["param"] is None and ONE_CONSTRAINT in error["message"]:
        return
    param = re.sub(r"\[\d+\]", "[]", error["param"] or "") or None  # one rule per array field
    assert (param, error["code"]) in CROSS_FIELD_RULES, (
        f"schema-valid request rejected: {response.status_code} {error}\n{case.body!r} "
        f"{response.request.url!r}"
    )


def _openai_shaped(response: Any) -> None:
    if response.status_code < 400:
        return
    body = json.loads(response.content)
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operation_holds_every_check(server: Server, mode: GenerationMode) -> None:
    operations = _operations(server)
    if mode is GenerationMode.NEGATIVE:  # only a request body can be made schema-invalid
        operations = [op for op in operations if op.method.upper() == "POST" and op.body]
    assert operations
    for operation in operations:
        minimum = MIN_EXAMPLES if operation.body else 1  # no parameters: one distinct case
        assert _fuzz(operation, mode) >= minimum, operation.label


def _fuzz(operation: Any, mode: GenerationMode) -> int:
    """Run the operation's generated cases; how many were sent."""
    sent: list[int] = []

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        response = case.call(timeout=60)
        sent.append(response.status_code)
        case.validate_response(response, checks=CHECKS)
        _openai_shaped(response)
        if mode is GenerationMode.POSITIVE:
            _accepted_or_cross_field(case, response)

    run()
    return len(sent)
