"""The routes in-process (Starlette's TestClient, lifespan on) over a ready tiny-Llama engine:
exact response bodies, logprobs, stop strings, accepted and refused fields, errors.

TestClient buffers whole responses, so only finite bodies are read here (a short stream is
finite); disconnects and long streams are tested against a real uvicorn in test_server.py.
Expected texts and logprobs come from a second, in-process engine on the same weights.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient
from tokenizers.processors import TemplateProcessing
from transformers import PreTrainedTokenizerFast

from engine import (
    AsyncEngine,
    EngineConfig,
    LLMEngine,
    SampleLogprobs,
    SamplingParams,
    chat_prompt_ids,
    text_prompt_ids,
)
from engine.executor.kernels import kernel_target
from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.engine_client import ReplicaHealth, ReplicaState
from gateway.logprobs import _piece, completion_logprobs, echo_logprobs
from tests.gateway.server_harness import Reference, greedy
from tests.helpers import save_tiny_llama, tiny_app

MODEL = "tiny-llama"
BLOCK_SIZE = 4
NUM_KV_BLOCKS = 512
MAX_MODEL_LEN = 256
NUM_TOKENS = 8
SYSTEM = "You are a helpful assistant. Answer the question briefly and politely."
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the capital of France?"},
]
PROMPT = "The quick brown fox jumps over the lazy dog."
CHAT = {
    "model": MODEL,
    "messages": MESSAGES,
    "temperature": 0,
    "max_tokens": NUM_TOKENS,
    "ignore_eos": True,
}
COMPLETION = {
    "model": MODEL,
    "prompt": PROMPT,
    "temperature": 0,
    "max_tokens": NUM_TOKENS,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def engine_config(tiny_llama_path: Path) -> EngineConfig:
    return EngineConfig(
        model=str(tiny_llama_path),
        dtype="float32",  # logprobs asserted against a float32 reference
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_KV_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        debug_check_integrity=True,  # the pool's invariants after every step
        # Usage is asserted exactly, request by request: the automatic cache would make it
        # depend on which test ran first (it has its own tests, and test_cached_tokens_*).
        enable_auto_prefix_cache=False,
    )


@pytest.fixture(scope="module")
def app(engine_config: EngineConfig) -> Starlette:
    engine = AsyncEngine(engine_config, engine=LLMEngine(engine_config))
    return create_app(GatewayConfig(engine=engine_config), engine=engine)


@pytest.fixture(scope="module")
def module_client(app: Starlette) -> Iterator[TestClient]:
    with TestClient(app) as client:  # runs the lifespan: the engine thread stops at the end
        yield client


@pytest.fixture
def client(module_client: TestClient, app: Starlette) -> Iterator[TestClient]:
    """After each test: every block is free again and each block's ref_cnt equals its holders."""
    yield module_client
    engine: AsyncEngine = app.state.gateway.engine
    asyncio.run(engine.run_in_engine(lambda e: e.check_integrity()))
    stats = engine.stats()
    assert (stats.num_requests_running, stats.num_requests_waiting) == (0, 0)
    assert stats.num_free_kv_blocks == stats.num_kv_blocks == NUM_KV_BLOCKS


@pytest.fixture(scope="module")
def reference(tiny_llama_path: Path) -> Reference:
    return Reference(tiny_llama_path, BLOCK_SIZE, NUM_KV_BLOCKS, MAX_MODEL_LEN)


def _post(client: TestClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def _samples(reference: Reference, prompt_ids: list[int], top: int) -> list[SampleLogprobs]:
    outputs = reference.run(prompt_ids, greedy(NUM_TOKENS, logprobs=top))
    return [s for o in outputs for s in o.logprobs or []]


# -- exact shapes ------------------------------------------------------------------------------


def test_chat_completion_body(client: TestClient, reference: Reference) -> None:
    body = _post(client, "/v1/chat/completions", CHAT)
    num_prompt = len(reference.chat_ids(MESSAGES))
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{24}", body.pop("id"))
    assert isinstance(body.pop("created"), int)
    assert body == {
        "object": "chat.completion",
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": reference.chat(MESSAGES, NUM_TOKENS)},
                "finish_reason": "length",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": num_prompt,
            "completion_tokens": NUM_TOKENS,
            "total_tokens": num_prompt + NUM_TOKENS,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
        "system_fingerprint": None,
    }


def test_completion_body(client: TestClient, reference: Reference) -> None:
    body = _post(client, "/v1/completions", COMPLETION)
    num_prompt = len(reference.text_ids(PROMPT))
    assert re.fullmatch(r"cmpl-[0-9a-f]{24}", body.pop("id"))
    assert isinstance(body.pop("created"), int)
    assert body == {
        "object": "text_completion",
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "text": reference.completion(PROMPT, NUM_TOKENS),
                "finish_reason": "length",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": num_prompt,
            "completion_tokens": NUM_TOKENS,
            "total_tokens": num_prompt + NUM_TOKENS,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
        "system_fingerprint": None,
    }


def _sse_events(text: str) -> list[str]:
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e.removeprefix("data: ") for e in events]


def test_chat_stream_chunk_order(client: TestClient, reference: Reference) -> None:
    """A finite stream: role chunk, content chunks, finish chunk, usage chunk, [DONE]."""
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    *events, done = _sse_events(response.text)
    assert done == "[DONE]"
    chunks = [json.loads(e) for e in events]
    assert len({c["id"] for c in chunks}) == 1
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    first, *content, finish, usage = chunks
    assert first["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "finish_reason": None,
            "logprobs": None,
        }
    ]
    assert first["usage"] is None  # nulls are kept, as OpenAI sends them
    assert all(list(c["choices"][0]["delta"]) == ["content"] for c in content)
    text = "".join(c["choices"][0]["delta"]["content"] for c in content)
    assert text == reference.chat(MESSAGES, NUM_TOKENS)
    assert finish["choices"] == [
        {"index": 0, "delta": {}, "finish_reason": "length", "logprobs": None}
    ]
    num_prompt = len(reference.chat_ids(MESSAGES))
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": NUM_TOKENS,
        "total_tokens": num_prompt + NUM_TOKENS,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_stream_chunks_keep_nulls_like_openai(client: TestClient, route: str) -> None:
    base = CHAT if route == "/v1/chat/completions" else COMPLETION
    body = {**base, "stream": True, "stream_options": {"include_usage": True}}
    response = client.post(route, json=body)
    assert response.status_code == 200
    chunks = [json.loads(e) for e in _sse_events(response.text)[:-1]]
    *with_choices, _ = chunks
    for chunk in with_choices:
        assert chunk["usage"] is None
        [choice] = chunk["choices"]
        assert "finish_reason" in choice and "logprobs" in choice
        assert choice["logprobs"] is None


# -- logprobs ----------------------------------------------------------------------------------


def _expected_piece(tokenizer: Any, token_id: int) -> tuple[str, list[int]]:
    """(token, bytes) as OpenAI reports them: the token's text, or `bytes:\\x..` when the
    token holds only part of a character; bytes are the token's own bytes."""
    raw = [_byte_decoder()[c] for c in tokenizer.convert_ids_to_tokens(token_id)]
    text = tokenizer.decode([token_id])
    if "\ufffd" in text:
        text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text, raw


def test_chat_logprobs(client: TestClient, reference: Reference) -> None:
    body = _post(client, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3})
    content = body["choices"][0]["logprobs"]["content"]
    samples = _samples(reference, reference.chat_ids(MESSAGES), 3)
    tok = reference.tokenizer
    assert len(content) == len(samples) == NUM_TOKENS
    for entry, sample in zip(content, samples, strict=True):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        token, raw = _expected_piece(tok, sample.token_id)
        assert (entry["token"], entry["bytes"], entry["logprob"]) == (token, raw, sample.logprob)
        assert [(t["token"], t["bytes"], t["logprob"]) for t in entry["top_logprobs"]] == [
            (*_expected_piece(tok, alt.token_id), alt.logprob) for alt in sample.top
        ]
        assert len(entry["top_logprobs"]) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry["logprob"] == entry["top_logprobs"][0]["logprob"] <= 0
    joined = b"".join(bytes(e["bytes"]) for e in content).decode(errors="replace")
    assert joined == body["choices"][0]["message"]["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_top_logprobs_hold_the_sampled_token(client: TestClient, stream: bool) -> None:
    """OpenAI's legacy API always returns the sampled token's logprob among the top ones (up
    to logprobs + 1 entries): sampled hot, many tokens are not among the 1 most likely."""
    body = {**COMPLETION, "logprobs": 1, "temperature": 2.0, "seed": 7, "max_tokens": 24}
    body |= {"echo": True, "stream": stream}
    if stream:
        with client.stream("POST", "/v1/completions", json=body) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        chunks = [json.loads(e)["choices"][0]["logprobs"] for e in events[:-1]]
        logprobs = {k: [v for c in chunks for v in c[k]] for k in ("tokens", "token_logprobs")}
        logprobs["top_logprobs"] = [v for c in chunks for v in c["top_logprobs"]]
    else:
        logprobs = _post(client, "/v1/completions", body)["choices"][0]["logprobs"]
    entries = list(
        zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True)
    )
    assert entries[0][1:] == (None, None)  # the prompt's first token: nothing before it
    outside = 0
    for token, logprob, top in entries[1:]:
        assert top[token] == logprob and 1 <= len(top) <= 2, (token, logprob, top)
        outside += len(top) == 2
    assert outside >= 3  # the case this is about did happen, in the prompt and the sample


def test_completion_logprobs(client: TestClient, reference: Reference) -> None:
    body = _post(client, "/v1/completions", {**COMPLETION, "logprobs": 2})
    choice = body["choices"][0]
    logprobs = choice["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    samples = _samples(reference, reference.text_ids(PROMPT), 2)
    tok = reference.tokenizer
    pieces = [_expected_piece(tok, s.token_id) for s in samples]
    assert logprobs["tokens"] == [token for token, _ in pieces]
    assert logprobs["token_logprobs"] == [s.logprob for s in samples]
    assert logprobs["top_logprobs"] == [
        {_expected_piece(tok, alt.token_id)[0]: alt.logprob for alt in s.top} for s in samples
    ]  # greedy: each token is the first of its alternatives
    # Where each token's text starts in `text`, as the detokenizer emitted it.
    emitted = [o.text for o in reference.run(reference.text_ids(PROMPT), greedy(NUM_TOKENS))]
    assert logprobs["text_offset"] == [len("".join(emitted[:i])) for i in range(len(emitted))]
    assert {len(v) for v in logprobs.values()} == {NUM_TOKENS}
    assert b"".join(bytes(raw) for _, raw in pieces).decode(errors="replace") == choice["text"]


def test_completion_top_logprobs_keep_every_alternative(client: TestClient) -> None:
    body = _post(client, "/v1/completions", {**COMPLETION, "logprobs": 2})
    tops = body["choices"][0]["logprobs"]["top_logprobs"]
    assert [len(top) for top in tops] == [2] * NUM_TOKENS


def _is_utf8(raw: list[int]) -> bool:
    try:
        bytes(raw).decode()
    except UnicodeDecodeError:
        return False
    return True


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: each character of a BPE token is one byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    others = [b for b in range(256) if b not in printable]
    chars = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(others))]
    return dict(zip(chars, printable + others, strict=True))


def test_chat_logprob_bytes_are_the_tokens_own_bytes(
    client: TestClient, reference: Reference
) -> None:
    body = _post(client, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3})
    samples = _samples(reference, reference.chat_ids(MESSAGES), 3)
    to_byte = _byte_decoder()
    tokenizer = reference.tokenizer

    def raw(token_id: int) -> list[int]:
        return [to_byte[c] for c in tokenizer.convert_ids_to_tokens(token_id)]

    expected = [[raw(s.token_id), *(raw(a.token_id) for a in s.top)] for s in samples]
    # This seeded model does propose tokens that hold part of a character.
    assert not all(_is_utf8(b) for row in expected for b in row)
    content = body["choices"][0]["logprobs"]["content"]
    got = [[e["bytes"], *(t["bytes"] for t in e["top_logprobs"])] for e in content]
    assert got == expected


# -- stop strings ------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_stop_string_ends_the_text_before_it(
    client: TestClient, reference: Reference, route: str
) -> None:
    is_chat = route == "/v1/chat/completions"
    base = {**(CHAT if is_chat else COMPLETION), "max_tokens": 16}
    full = reference.chat(MESSAGES, 16) if is_chat else reference.completion(PROMPT, 16)
    stop = full[6:9]
    assert stop.strip() and len(full) > 9
    cut = full.index(stop)
    body = _post(client, route, {**base, "stop": [stop, "never appears"]})
    choice = body["choices"][0]
    text = choice["message"]["content"] if is_chat else choice["text"]
    assert text == full[:cut]
    assert stop not in text
    assert choice["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] < 16


# -- accepted and refused fields ---------------------------------------------------------------


def test_unknown_fields_are_accepted_and_ignored(client: TestClient, reference: Reference) -> None:
    extra = {"prompt_cache_key": "user-42", "store": False, "metadata": {"team": "search"}}
    body = _post(client, "/v1/chat/completions", {**CHAT, **extra})
    assert body["choices"][0]["message"]["content"] == reference.chat(MESSAGES, NUM_TOKENS)
    completion = _post(client, "/v1/completions", {**COMPLETION, **extra})
    assert completion["choices"][0]["text"] == reference.completion(PROMPT, NUM_TOKENS)


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("/v1/chat/completions", {**CHAT, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ("/v1/completions", {**COMPLETION, "prompt": [[1] * MAX_MODEL_LEN]}, "prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": [[]]}, "prompt"),
    ],
    ids=["chat-max-tokens", "completion-max-tokens", "completion-too-long", "empty-ids"],
)
def test_prompt_errors_name_the_route_field(
    client: TestClient, route: str, body: dict[str, object], field: str
) -> None:
    """The engine speaks of "the prompt"; each route names the field the prompt came from.
    A prompt that fits with a max_tokens that does not names max_tokens."""
    response = client.post(route, json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field


# -- /tokenize, /detokenize ------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tokenize_gives_the_prompt_the_generation_routes_give_the_model(
    client: TestClient, app: Starlette
) -> None:
    """A chat body through the chat template (its tools too), a completion body's prompt as
    /v1/completions reads it: the ids, and the usage those routes report agrees."""
    tokenizer = app.state.gateway.engine.tokenizer
    chat_ids = chat_prompt_ids(tokenizer, MESSAGES)
    with_tools = chat_prompt_ids(tokenizer, MESSAGES, tools=[WEATHER_TOOL])
    assert with_tools != chat_ids
    cases = [
        (CHAT, chat_ids),
        ({**CHAT, "tools": [WEATHER_TOOL]}, with_tools),
        (COMPLETION, text_prompt_ids(tokenizer, PROMPT)),
        ({**COMPLETION, "prompt": [5, 6, 7]}, [5, 6, 7]),
    ]
    for body, ids in cases:
        # `model` may be left out (vLLM's route, and /detokenize): the served one
        without_model = {k: v for k, v in body.items() if k != "model"}
        for sent in (body, without_model, {**without_model, "model": None}):
            response = client.post("/tokenize", json=sent)
            assert response.status_code == 200, response.text
            assert response.json() == {
                "count": len(ids),
                "max_model_len": MAX_MODEL_LEN,
                "tokens": ids,
                "token_strs": tokenizer.convert_ids_to_tokens(ids),
            }
    usage = client.post("/v1/chat/completions", json=CHAT).json()["usage"]
    assert usage["prompt_tokens"] == len(chat_ids)


# A ChatML template that also reads two variables of its own, as Qwen3's reads enable_thinking.
KWARGS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}({{ m.reasoning_content }}){% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if greeting is defined %}{{ greeting ~ '!' }}{% endif %}"
    "{% if count is defined %}{{ count + 1 }}{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_template_kwargs_reach_the_template(
    client: TestClient, app: Starlette, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`chat_template_kwargs` (vLLM's extension) are the template's variables, in every route
    that renders a chat; a name the server sets, or a value the template cannot use, is a 400
    naming what is wrong, not a 500."""
    tokenizer = app.state.gateway.engine.tokenizer
    monkeypatch.setattr(tokenizer, "chat_template", KWARGS_TEMPLATE)
    kwargs = {"greeting": "Bonjour", "count": 41}
    expected = chat_prompt_ids(tokenizer, MESSAGES, template_kwargs=kwargs)
    assert expected != chat_prompt_ids(tokenizer, MESSAGES)
    assert "Bonjour!42" in tokenizer.decode(expected)
    body = {**CHAT, "chat_template_kwargs": kwargs}
    assert _post(client, "/tokenize", body)["tokens"] == expected
    usage = _post(client, "/v1/chat/completions", body)["usage"]
    assert usage["prompt_tokens"] == len(expected)
    for bad, param, words in [
        ({"messages": []}, "chat_template_kwargs", "may not set 'messages'"),
        ({"add_generation_prompt": False}, "chat_template_kwargs", "add_generation_prompt"),
        ({"conversation": []}, "chat_template_kwargs", "'conversation'"),
        ({"tokenize": True}, "chat_template_kwargs", "'tokenize'"),
        ({"count": "forty-one"}, "messages", "TypeError"),
    ]:
        for path in ("/v1/chat/completions", "/tokenize"):
            response = client.post(path, json={**CHAT, "chat_template_kwargs": bad})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == param and words in error["message"], error
    response = client.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": [1]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "chat_template_kwargs"


def test_an_assistant_turns_reasoning_reaches_the_template(
    client: TestClient, app: Starlette, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thinking model's earlier reasoning sent back with its turn (`reasoning_content`, or
    `reasoning` as newer vLLM names it) is the template's to write; on another role it is a
    400."""
    tokenizer = app.state.gateway.engine.tokenizer
    monkeypatch.setattr(tokenizer, "chat_template", KWARGS_TEMPLATE)
    turns = [*MESSAGES, {"role": "assistant", "content": "Paris."}, MESSAGES[-1]]
    for field in ("reasoning_content", "reasoning"):
        with_reasoning = [*turns[:-2], {**turns[-2], field: "It is the capital."}, turns[-1]]
        ids = _post(client, "/tokenize", {**CHAT, "messages": with_reasoning})["tokens"]
        assert "(It is the capital.)Paris." in tokenizer.decode(ids)
    on_user = [*turns[:-1], {**turns[-1], "reasoning_content": "no"}]
    response = client.post("/v1/chat/completions", json={**CHAT, "messages": on_user})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == f"messages[{len(on_user) - 1}].reasoning_content"


def test_tokenize_counts_a_prompt_past_the_context(client: TestClient) -> None:
    """Counting is what a client does to budget a prompt: one too long is counted, not
    refused (the generation routes refuse it)."""
    body = {**COMPLETION, "prompt": [5] * (MAX_MODEL_LEN + 10)}
    assert client.post("/tokenize", json=body).json()["count"] == MAX_MODEL_LEN + 10
    assert client.post("/v1/completions", json=body).status_code == 400


def test_detokenize_is_the_text_of_the_ids(client: TestClient, app: Starlette) -> None:
    tokenizer = app.state.gateway.engine.tokenizer
    ids = client.post("/tokenize", json=CHAT).json()["tokens"]
    response = client.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert response.json() == {"prompt": tokenizer.decode(ids)}
    assert "<|im_start|>" in response.json()["prompt"]  # special tokens kept
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {**CHAT, "model": "other"}, 404, "model"),
        ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
        ("/detokenize", {"tokens": [1.5]}, 400, "tokens[0]"),
        ("/detokenize", {}, 400, "tokens"),
        ("/tokenize", {"model": MODEL}, 400, "prompt"),
    ],
)
def test_bad_token_bodies_are_openai_errors(
    client: TestClient, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    response = client.post(path, json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


# -- health, unknown routes --------------------------------------------------------------------


def test_health(client: TestClient) -> None:
    response = client.get("/health")
    # the kernels built for the capability torch runs with: the test process's own
    expected = {"status": "ok", "model": MODEL, "cpu_kernels": kernel_target()}
    assert (response.status_code, response.json()) == (200, expected)


class _Replicas(AsyncEngine):
    """An engine that answers as a replica set would (the ingress's `ReplicaSet`)."""

    replica_health = ReplicaHealth()

    def replica_states(self) -> list[ReplicaState]:
        return [
            ReplicaState("r1", self.stats(), pid=4242, streaming=3),
            ReplicaState("?", None, "a replica did not answer within 2 s"),
        ]

    def health(self) -> ReplicaHealth:
        return self.replica_health


@pytest.mark.parametrize(
    ("state", "status", "body"),
    [
        (ReplicaHealth(), 200, {"status": "ok"}),
        (
            ReplicaHealth(degraded="1 of 2 engine replicas serve"),
            200,  # the others serve: a load balancer keeps sending traffic
            {"status": "degraded", "detail": "1 of 2 engine replicas serve"},
        ),
    ],
)
def test_health_and_listing_of_replicas(
    engine_config: EngineConfig, state: ReplicaHealth, status: int, body: dict[str, Any]
) -> None:
    engine = _Replicas(engine_config, engine=LLMEngine(engine_config))
    engine.replica_health = state
    app = create_app(GatewayConfig(engine=engine_config), engine=engine)
    with TestClient(app) as client:
        response = client.get("/health")
        expected = {**body, "model": MODEL, "cpu_kernels": kernel_target()}
        assert (response.status_code, response.json()) == (status, expected)
        cards = client.get("/v1/prefixes").json()["replicas"]
        assert [(c["name"], c["pid"], c["streaming"], c["error"]) for c in cards] == [
            ("r1", 4242, 3, None),
            ("?", None, 0, "a replica did not answer within 2 s"),
        ]


def test_replicas_that_hold_different_registries_are_a_503(engine_config: EngineConfig) -> None:
    engine = _Replicas(engine_config, engine=LLMEngine(engine_config))
    engine.replica_health = ReplicaHealth("the replicas hold different registries (a=1, b=2)")
    with TestClient(create_app(GatewayConfig(engine=engine_config), engine=engine)) as client:
        response = client.get("/health")
        assert response.status_code == 503
        assert "the replicas hold different registries" in response.json()["error"]["message"]


def test_unknown_route_is_an_openai_404(client: TestClient) -> None:
    response = client.get("/v1/does-not-exist")
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "Invalid URL (GET /v1/does-not-exist)",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }


def test_wrong_method_is_an_openai_405(client: TestClient) -> None:
    response = client.get("/v1/chat/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json() == {
        "error": {
            "message": "Method GET is not allowed for /v1/chat/completions.",
            "type": "invalid_request_error",
            "param": None,
            "code": "method_not_allowed",
        }
    }


def test_retrieve_the_served_model_or_404(client: TestClient) -> None:
    listed = client.get("/v1/models").json()["data"][0]
    assert client.get(f"/v1/models/{MODEL}").json() == listed
    response = client.get("/v1/models/org/other-model")
    assert response.status_code == 404
    assert response.json()["error"] == {
        "message": "The model `org/other-model` does not exist or you do not have access to it.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


@pytest.mark.parametrize(
    ("sent", "echoed"),
    [("req-42", True), ("a" * 128, True), ("a" * 129, False), ("two words", False)],
)
def test_x_request_id_is_echoed_when_usable(client: TestClient, sent: str, echoed: bool) -> None:
    for response in (
        client.get("/v1/models", headers={"x-request-id": sent}),
        client.post("/v1/completions", json={"model": "nope"}, headers={"x-request-id": sent}),
        client.post("/v1/completions", json=COMPLETION, headers={"x-request-id": sent}),
    ):
        got = response.headers["x-request-id"]
        assert (got == sent) is echoed
        assert echoed or re.fullmatch(r"[0-9a-f]{32}", got)


def test_every_response_gets_its_own_request_id(client: TestClient) -> None:
    ids = {client.get("/health").headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3


# -- completions: echo and suffix --------------------------------------------------------------


def test_echo_returns_the_prompt_before_the_completion(client: TestClient) -> None:
    plain = _post(client, "/v1/completions", COMPLETION)["choices"][0]["text"]
    echoed = _post(client, "/v1/completions", {**COMPLETION, "echo": True})["choices"][0]
    assert echoed["text"] == PROMPT + plain
    by_ids = {**COMPLETION, "prompt": [285, 324, 375], "echo": True}
    assert _post(client, "/v1/completions", by_ids)["choices"][0]["text"].startswith("The model")


def test_echo_with_logprobs_scores_the_prompt(client: TestClient, reference: Reference) -> None:
    """lm-evaluation-harness's loglikelihood call: echo, logprobs, max_tokens 0."""
    body = {**COMPLETION, "echo": True, "logprobs": 2, "max_tokens": 0}
    [choice] = _post(client, "/v1/completions", body)["choices"]
    ids = reference.text_ids(PROMPT)
    [scored] = reference.run(ids, SamplingParams(max_tokens=0, prompt_logprobs=2))
    expected = echo_logprobs(reference.tokenizer, ids, scored.prompt_logprobs)
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert logprobs == expected.model_dump(mode="json")
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    values = [s.logprob for s in scored.prompt_logprobs[1:]]
    assert logprobs["token_logprobs"][1:] == values
    assert logprobs["tokens"][0] == _piece(reference.tokenizer, ids[0])


def test_echo_logprobs_then_the_completions_own(client: TestClient, reference: Reference) -> None:
    body = {**COMPLETION, "echo": True, "logprobs": 1, "max_tokens": 3}
    [choice] = _post(client, "/v1/completions", body)["choices"]
    ids = reference.text_ids(PROMPT)
    outputs = reference.run(ids, greedy(3, logprobs=1))
    offsets = [len(PROMPT) + len("".join(o.text for o in outputs[:i])) for i in range(3)]
    samples = [s for o in outputs for s in o.logprobs or []]
    completion = completion_logprobs(reference.tokenizer, samples, offsets)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 3
    assert logprobs["tokens"][len(ids) :] == completion.tokens
    assert logprobs["token_logprobs"][len(ids) :] == completion.token_logprobs
    assert logprobs["text_offset"][len(ids) :] == completion.text_offset


@pytest.mark.parametrize("route", ["chat", "responses"])
def test_a_bug_mid_stream_ends_the_stream_as_a_server_error(
    client: TestClient, app: Starlette, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    """An unexpected exception of ours once a stream has started can no longer be a 500: the
    stream ends with an error event as a 500's body (chat: then [DONE]; Responses:
    response.failed), never cut short without one; its engine request is let go."""
    from gateway.routes import chat, responses

    def broken(*args: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(chat if route == "chat" else responses, "chat_logprobs", broken)
    if route == "chat":
        body, path = (
            {**CHAT, "logprobs": True, "stream": True, "max_tokens": 64},
            "/v1/chat/completions",
        )
    else:
        body = {"model": MODEL, "input": "Hi", "stream": True, "top_logprobs": 1}
        body |= {"include": ["message.output_text.logprobs"], "max_output_tokens": 64}
        path = "/v1/responses"
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    if route == "chat":
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
    else:
        last = json.loads(events[-1])
        assert last["type"] == "response.failed"
        error = last["response"]["error"]
        error = {"type": error["code"], "message": error["message"]}
    assert error["type"] == "server_error"
    assert error["message"] == "The server had an error while processing your request."
    engine = app.state.gateway.engine
    for _ in range(500):
        stats = engine.stats()
        if stats.num_requests_running == stats.num_requests_waiting == 0:
            break
        threading.Event().wait(0.01)
    assert stats.num_requests_running == stats.num_requests_waiting == 0


def test_echo_streams_the_prompt_in_the_first_chunk(client: TestClient) -> None:
    body = {**COMPLETION, "echo": True, "logprobs": 1, "stream": True}
    whole = _post(client, "/v1/completions", {**body, "stream": False})["choices"][0]
    with client.stream("POST", "/v1/completions", json=body) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert chunks[0]["text"].startswith(PROMPT)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks for t in c["logprobs"]["tokens"]] == whole["logprobs"]["tokens"]
    offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]


@pytest.fixture(scope="module")
def bos_client(
    tiny_tokenizer: PreTrainedTokenizerFast, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TestClient]:
    """The tiny Llama over a tokenizer that puts a BOS before every text it encodes (as
    Gemma's and Llama's do): that token is in the prompt, not in the text a client sent."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    bos = "<|endoftext|>"
    bos_id = tokenizer.convert_tokens_to_ids(bos)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )
    path = save_tiny_llama(tokenizer, tmp_path_factory.mktemp("bos") / MODEL)
    with TestClient(tiny_app(path, max_model_len=MAX_MODEL_LEN)) as test_client:
        yield test_client


def _assert_offsets_locate_tokens(logprobs: dict[str, Any], text: str, first: int) -> None:
    """Each token from `first` on starts at its text_offset in `text` (tokens that hold part
    of a character, written as bytes, start where the character does), in order."""
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] < len(text)
    for token, offset in list(zip(logprobs["tokens"], offsets, strict=True))[first:]:
        if not token.startswith("bytes:"):
            assert text[offset:].startswith(token), (token, offset, text[offset:])


@pytest.mark.parametrize("stream", [False, True])
def test_echo_offsets_leave_out_the_bos_the_tokenizer_added(
    bos_client: TestClient, stream: bool
) -> None:
    """A text prompt is echoed as sent: the BOS its tokenization added takes none of that
    text (it and the first word both start at 0), and every later token, the completion's
    too, starts where its text is. Token ids are echoed as their decoded text, BOS
    included."""
    prompt = "Café naïve résumé: 日本語 and 😀 too."
    body = {**COMPLETION, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 4}
    [choice] = _post(bos_client, "/v1/completions", body)["choices"]
    text, logprobs = choice["text"], choice["logprobs"]
    assert text.startswith(prompt)
    assert logprobs["tokens"][0] == "<|endoftext|>" and logprobs["text_offset"][:2] == [0, 0]
    _assert_offsets_locate_tokens(logprobs, text, first=1)
    if stream:
        with bos_client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        assert "".join(c["text"] for c in chunks) == text
        streamed = [o for c in chunks for o in c["logprobs"]["text_offset"]]
        assert streamed == logprobs["text_offset"]
    ids = bos_client.post("/tokenize", json={"model": MODEL, "prompt": prompt}).json()["tokens"]
    [by_ids] = _post(bos_client, "/v1/completions", {**body, "prompt": ids})["choices"]
    assert by_ids["text"].startswith("<|endoftext|>" + prompt)
    assert by_ids["logprobs"]["tokens"] == logprobs["tokens"]
    _assert_offsets_locate_tokens(by_ids["logprobs"], by_ids["text"], first=0)


def test_suffix_without_a_fill_in_the_middle_format_is_400(client: TestClient) -> None:
    response = client.post("/v1/completions", json={**COMPLETION, "suffix": "return x"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("suffix", "unsupported_value")
    assert error["message"].startswith("suffix needs a model with a fill-in-the-middle format")


def test_suffix_with_echo_is_400(client: TestClient) -> None:
    """The prompt goes out wrapped in fill-in-the-middle tokens around the suffix: no echoed
    text and offsets could show that as the prompt sent."""
    body = {**COMPLETION, "suffix": "return x", "echo": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("suffix", "unsupported_value")
    assert "cannot be combined with 'echo': true" in error["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/chat/completions", {**CHAT, "n": 2}), ("/v1/completions", {**COMPLETION, "n": 2})],
)
def test_the_client_s_request_id_names_its_engine_requests(
    client: TestClient, caplog: pytest.LogCaptureFixture, path: str, body: dict[str, Any]
) -> None:
    """What a client sends as x-request-id is what the engine's log lines say: choice i is
    engine request "<x-request-id>-<i>-<8 hex digits>". The digits are the HTTP request's
    own: a second request with the same header (a proxy's fixed id, a retry; concurrent
    ones failed as duplicate engine requests) is other engine requests."""
    names = []
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="engine.llm_engine"):
            response = client.post(path, json=body, headers={"x-request-id": "trace-7f3a"})
        assert response.status_code == 200
        messages = [r.getMessage() for r in caplog.records if r.name == "engine.llm_engine"]
        named = {
            m.split(":")[0].split(" finished")[0] for m in messages if m.startswith("request ")
        }
        assert sum(" finished (length)" in m for m in messages) == 2
        assert len(named) == 2
        for choice in (0, 1):
            [name] = [
                n for n in named if re.fullmatch(rf"request trace-7f3a-{choice}-[0-9a-f]{{8}}", n)
            ]
            names.append(name)
    assert len(set(names)) == 4


def test_logprob_token_texts_are_decoded_once_after_start_off_the_event_loop(
    engine_config: EngineConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Top logprobs name 21 tokens per streamed token: their texts come from a table the
    worker pool decodes once the app started (not before /health turns 200), never from the
    tokenizer on the event loop; a request with logprobs waits for the table."""
    from gateway import logprobs

    threads: list[str] = []
    decode = logprobs._decode_piece

    def record(tokenizer: Any, token_id: int) -> str:
        if not threads:
            time.sleep(1.0)  # a slow table: the request below arrives before it is done
        threads.append(threading.current_thread().name)
        return decode(tokenizer, token_id)

    monkeypatch.setattr(logprobs, "_decode_piece", record)
    logprobs.token_pieces.cache_clear()
    engine = AsyncEngine(engine_config, engine=LLMEngine(engine_config))
    app = create_app(GatewayConfig(engine=engine_config), engine=engine)
    with TestClient(app) as client:
        body = {**CHAT, "logprobs": True, "top_logprobs": 5, "stream": True}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200 and '"top_logprobs"' in response.text
        vocabulary = len(engine.tokenizer)
    logprobs.token_pieces.cache_clear()  # the table holds this test's tokenizer
    assert len(threads) == vocabulary  # each token once, for the table
    assert {name.split("_")[0] for name in threads} == {"prefixgate-tokenize"}
