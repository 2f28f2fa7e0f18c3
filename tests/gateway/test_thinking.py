"""A thinking model through the API (in-process): a tiny Llama whose tokenizer holds `<think>`
and `</think>` as tokens (not special, as Qwen3's) and whose template writes them, so the
gateway reads it as a thinking model by itself. Its reasoning comes apart from its answer,
and a constrained answer (response format, tool grammar, named call) may think first: the
grammar holds from the end of the think block, unless the prompt closed the block.

The random model never chooses the tags on its own; `logit_bias` makes it write them where
the grammar allows them (a +100 bias wins over any logit, and a masked token stays masked)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from starlette.testclient import TestClient
from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast

from tests.gateway.test_structured_outputs import SCHEMA
from tests.helpers import save_tiny_llama, tiny_app

MODEL = "tiny-thinker"
# Qwen3's shape: `enable_thinking: false` writes an empty block into the prompt; our own
# `open_thinking` opens it there, as the DeepSeek-R1 distills' templates do.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% if open_thinking %}<think>\n{% endif %}"
    "{% endif %}"
)
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": SCHEMA}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "refund",
            "parameters": {
                "type": "object",
                "properties": {"order": {"type": "integer", "minimum": 1, "maximum": 99}},
                "required": ["order"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "escalate",
            "parameters": {
                "type": "object",
                "properties": {"reason": {"enum": ["fraud", "other"]}},
                "required": ["reason"],
                "additionalProperties": False,
            },
        },
    },
]
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "My card was charged twice."}],
    "temperature": 0,
    "max_tokens": 60,
}


@pytest.fixture(scope="module")
def thinker_path(
    tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: PreTrainedTokenizerFast
) -> Path:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tiny_tokenizer.backend_tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.add_tokens(
        [AddedToken("<think>", special=False), AddedToken("</think>", special=False)]
    )
    tokenizer.chat_template = TEMPLATE
    path = tmp_path_factory.mktemp("models") / MODEL
    return save_tiny_llama(tokenizer, path, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def client(thinker_path: Path) -> Iterator[TestClient]:
    app = tiny_app(
        thinker_path,
        {"served_model_name": MODEL},
        num_kv_blocks=1024,
        max_model_len=1024,  # the tools' description makes long prompts
    )
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def tags(client: TestClient) -> tuple[int, int]:
    """The tags' token ids, as the served tokenizer has them."""
    gateway = client.app.state.gateway  # type: ignore[attr-defined]
    think = gateway.reasoning_format
    assert think is not None, "the gateway reads the tiny model as a thinking model"
    return think.open_id, think.close_id


def _post(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def _bias(*token_ids: int) -> dict[str, float]:
    return {str(token_id): 100.0 for token_id in token_ids}


def _streamed(client: TestClient, body: dict[str, Any]) -> tuple[str, str, list[Any], list[str]]:
    """(the reasoning deltas joined, the content deltas joined, the tool-call deltas, the
    finish reasons) of the same request streamed."""
    response = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert response.status_code == 200, response.text
    lines = [
        line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")
    ]
    assert lines[-1] == "[DONE]"
    deltas = [json.loads(line)["choices"][0] for line in lines[:-1]]
    return (
        "".join(d["delta"].get("reasoning_content") or "" for d in deltas),
        "".join(d["delta"].get("content") or "" for d in deltas),
        [call for d in deltas for call in d["delta"].get("tool_calls") or []],
        [d["finish_reason"] for d in deltas if d["finish_reason"]],
    )


def test_a_thinking_models_reasoning_comes_apart_from_its_answer(
    client: TestClient, tags: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The think block becomes `reasoning_content` and the rest `content`, whole and streamed
    alike, and usage counts the block's tokens; an answer cut inside the block is all
    reasoning; served as a model that does not think, the same answer is content, tags and
    all. The answer is a client's grammar that spells the block out itself (thinking is
    off in the template, so the grammar holds from the first token)."""
    open_id, close_id = tags
    grammar = (
        f'start: <[{open_id}]> /[a-z]{{2,5}}( [a-z]{{2,5}}){{1,3}}/ <[{close_id}]> "\\n\\n" '
        "/(yes|no)[.!]/"
    )
    body = {
        **CHAT,
        "guided_grammar": grammar,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    gateway = client.app.state.gateway  # type: ignore[attr-defined]
    think = gateway.reasoning_format
    monkeypatch.setattr(gateway, "reasoning_format", None)
    plain = _post(client, {**body, "logprobs": True})
    raw = plain["choices"][0]["message"]["content"]
    assert "reasoning_content" not in plain["choices"][0]["message"]
    assert "completion_tokens_details" not in plain["usage"]
    match = re.fullmatch(r"<think>(.*)</think>\n\n(.*)", raw, re.S)
    assert match is not None, raw
    thought, answer = match.groups()
    # the tokens whose text starts before the closing tag's end are the reasoning's
    pieces = [entry["token"] for entry in plain["choices"][0]["logprobs"]["content"]]
    assert "".join(pieces) == raw
    starts = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
    block_end = raw.index("</think>") + len("</think>")
    num_reasoning = sum(1 for start in starts if start < block_end)

    monkeypatch.setattr(gateway, "reasoning_format", think)
    data = _post(client, body)
    message, finish = data["choices"][0]["message"], data["choices"][0]["finish_reason"]
    assert (message["reasoning_content"], message["content"], finish) == (thought, answer, "stop")
    assert data["usage"]["completion_tokens_details"] == {"reasoning_tokens": num_reasoning}
    assert 0 < num_reasoning < data["usage"]["completion_tokens"]
    assert _streamed(client, body) == (thought, answer, [], ["stop"])

    # cut inside the block: after its first word
    opening = [open_id, *gateway.tokenizer.encode(thought.split()[0], add_special_tokens=False)]
    cut = {**body, "max_tokens": len(opening)}
    data = _post(client, cut)
    message, finish = data["choices"][0]["message"], data["choices"][0]["finish_reason"]
    assert finish == "length" and message["content"] is None
    assert message["reasoning_content"] and thought.startswith(message["reasoning_content"])
    assert data["usage"]["completion_tokens_details"] == {"reasoning_tokens": len(opening)}
    assert _streamed(client, cut) == (message["reasoning_content"], "", [], ["length"])


def test_a_response_format_holds_after_the_think_block(
    client: TestClient, tags: tuple[int, int]
) -> None:
    """The model opens and closes a block (the grammar lets it), then writes JSON of the
    schema: the block is the reasoning, the JSON the content, whole and streamed alike, and
    usage counts the block's two tokens. Turned off in the prompt (an empty block there),
    the schema holds from the first token: the same bias cannot open a block."""
    body = {**CHAT, "response_format": RESPONSE_FORMAT, "logit_bias": _bias(*tags)}
    data = _post(client, body)
    message, finish = data["choices"][0]["message"], data["choices"][0]["finish_reason"]
    assert (message["reasoning_content"], finish) == ("", "stop")
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert data["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}
    assert _streamed(client, body) == ("", message["content"], [], ["stop"])

    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    data = _post(client, off)
    message = data["choices"][0]["message"]
    assert "reasoning_content" not in message
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert data["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_a_block_the_prompt_opened_is_closed_before_the_constrained_answer(
    client: TestClient, tags: tuple[int, int]
) -> None:
    """A template that opens the block for the model: the answer starts inside it, so the
    grammar takes the closing tag first (here at once), then the schema's JSON."""
    _, close = tags
    body = {
        **CHAT,
        "response_format": RESPONSE_FORMAT,
        "logit_bias": _bias(close),
        "chat_template_kwargs": {"open_thinking": True},
    }
    data = _post(client, body)
    message = data["choices"][0]["message"]
    assert message["reasoning_content"] == ""
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert data["usage"]["completion_tokens_details"] == {"reasoning_tokens": 1}


def test_an_answer_cut_inside_the_block_is_all_reasoning(
    client: TestClient, tags: tuple[int, int]
) -> None:
    """Inside the block the text is free (the schema does not hold there): cut by the length
    limit before the closing tag, the answer is reasoning and no content."""
    open_id, _ = tags
    body = {
        **CHAT,
        "response_format": RESPONSE_FORMAT,
        "logit_bias": _bias(open_id),
        "max_tokens": 8,
    }
    data = _post(client, body)
    choice = data["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    reasoning = choice["message"]["reasoning_content"]
    assert reasoning.strip() and not reasoning.lstrip().startswith("{"), reasoning
    assert data["usage"]["completion_tokens_details"] == {"reasoning_tokens": 8}
    assert _streamed(client, body) == (reasoning, "", [], ["length"])


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "refund"}}]
)
def test_a_forced_call_comes_after_the_think_block(
    client: TestClient, tags: tuple[int, int], tool_choice: Any
) -> None:
    """`required` and a named function: the call's opening is the grammar's to write after
    the block (not the prompt's), and the call is read from the content."""
    body = {
        **CHAT,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "logit_bias": _bias(*tags),
        "max_tokens": 150,  # the tiny tokenizer writes JSON a character a token
    }
    data = _post(client, body)
    choice = data["choices"][0]
    message = choice["message"]
    assert (message["reasoning_content"], message["content"]) == ("", None)
    assert choice["finish_reason"] == "tool_calls"
    [call] = message["tool_calls"][:1]
    if isinstance(tool_choice, dict):
        assert len(message["tool_calls"]) == 1
        assert call["function"]["name"] == "refund"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for each in message["tool_calls"]:
        jsonschema.validate(
            json.loads(each["function"]["arguments"]), schemas[each["function"]["name"]]
        )
    reasoning, content, calls, finishes = _streamed(client, body)
    assert (reasoning, content, finishes) == ("", "", ["tool_calls"])
    assert [c["function"] for c in calls] == [c["function"] for c in message["tool_calls"]]

    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    message = _post(client, off)["choices"][0]["message"]
    assert "reasoning_content" not in message and message["tool_calls"]

    # stopped at the closing tag (a stop string): no call was written, so none is read, and
    # a named call's closing is not put back as content
    stopped = {**body, "stop": ["</think>"]}
    choice = _post(client, stopped)["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert (choice["message"]["content"], choice["message"].get("tool_calls")) == (None, None)
    assert _streamed(client, stopped)[1:] == ("", [], ["stop"])
