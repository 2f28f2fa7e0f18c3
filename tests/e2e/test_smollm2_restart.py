"""A real `prefixgate serve` stopped with SIGTERM and started again on the same folders: the
registry's KV comes back from its snapshots (no prefill), a returning conversation finds its
earlier turns cached exactly as before the restart, stored Responses are still there, and
every answer is the one the first server gave."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.conftest import SHIPPED_PREFIXES
from tests.gateway.server_harness import REAL_READY_TIMEOUT, Server, ServerFactory

pytestmark = pytest.mark.e2e

CUSTOMER = "I was billed twice this month, please refund me."
FIRST = "Name three colours of the rainbow."
SECOND = "Now name two more, please."


def _model(server: Server) -> str:
    models: dict[str, Any] = server.get_json("/v1/models")
    return str(models["data"][0]["id"])


def _chat(server: Server, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {
        "model": _model(server),
        "messages": messages,
        "max_tokens": 16,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,  # compared too: the same bits, not only the same tokens
    }
    result: dict[str, Any] = server.post_json("/v1/chat/completions", body)
    return result


def _cached(result: dict[str, Any]) -> int:
    return int(result["usage"]["prompt_tokens_details"]["cached_tokens"])


def _intent(server: Server) -> dict[str, Any]:
    entries = yaml.safe_load(SHIPPED_PREFIXES.read_text())["prefixes"]
    [system] = [e["messages"][0]["content"] for e in entries if e["name"] == "intent-classifier"]
    return _chat(
        server, [{"role": "system", "content": system}, {"role": "user", "content": CUSTOMER}]
    )


def test_a_restart_keeps_the_registry_the_hot_cache_and_stored_responses(
    servers: ServerFactory, tmp_path: Path
) -> None:
    args = (
        *("--prefixes", str(SHIPPED_PREFIXES)),
        *("--kv-snapshot-dir", str(tmp_path / "kv")),
        *("--response-store", f"sqlite:{tmp_path / 'responses.sqlite3'}"),
    )
    first = servers(*args, ready_timeout=REAL_READY_TIMEOUT, name="before-restart")
    model = _model(first)
    turn1 = _chat(first, [{"role": "user", "content": FIRST}])
    answer = turn1["choices"][0]["message"]["content"]
    conversation = [
        {"role": "user", "content": FIRST},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": SECOND},
    ]
    assert _cached(_chat(first, conversation)) > 0  # the first turn's blocks, cached
    turn2 = _chat(first, conversation)  # the same turn again: what a replay finds cached
    intent = _intent(first)
    stored = first.post_json(
        "/v1/responses", {"model": model, "input": FIRST, "max_output_tokens": 8}
    )
    assert first.stop() == 0
    assert "KV snapshot" in first.log() and (tmp_path / "kv").is_dir()

    second = servers(*args, ready_timeout=REAL_READY_TIMEOUT, name="after-restart")
    log = second.log()
    assert log.count("restored from its KV snapshot") == 3, log
    assert "prefilling prefixes" not in log
    assert "blocks restored from the hot snapshot" in log
    again = _chat(second, conversation)
    assert _cached(again) == _cached(turn2)  # the conversation's cache survived
    assert again["choices"] == turn2["choices"]  # and answers the same, to the byte
    intent_again = _intent(second)
    assert _cached(intent_again) == _cached(intent) > 900  # the registered prefix
    assert intent_again["choices"] == intent["choices"]
    fetched = second.get_json(f"/v1/responses/{stored['id']}")
    assert fetched["output"] == stored["output"]
    chained = second.post_json(
        "/v1/responses",
        {
            "model": model,
            "input": SECOND,
            "previous_response_id": stored["id"],
            "max_output_tokens": 8,
        },
    )
    # the chain's history came from the store: the earlier input and output are in the prompt
    assert chained["previous_response_id"] == stored["id"]
    assert chained["usage"]["input_tokens"] > stored["usage"]["total_tokens"]
    assert second.stop() == 0
