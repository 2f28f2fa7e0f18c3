"""One real `prefixgate serve` (default model, shipped prefixes.yaml) for the e2e modules
that drive it with client libraries, started once per session; the questions the in-process
engine tests generate from."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams, chat_prompt_ids
from engine.core.outputs import SampleLogprobs
from engine.loading.source import ModelSource
from tests.gateway.server_harness import REAL_READY_TIMEOUT, REPO_ROOT, Server, ServerFactory

SHIPPED_PREFIXES = REPO_ROOT / "prefixes.yaml"
# One function tool in the two API shapes: chat nests it under "function", Responses is flat.
WEATHER_FUNCTION: dict[str, Any] = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CHAT_WEATHER_TOOL: Any = {"type": "function", "function": WEATHER_FUNCTION}
RESPONSES_WEATHER_TOOL: Any = {"type": "function", **WEATHER_FUNCTION}
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain gravity in one sentence to a child who is five years old and likes dinosaurs.",
    "Hi",
]


@dataclass(frozen=True)
class Answer:
    """A request's whole answer: what "same request, same answer" compares, bit for bit."""

    token_ids: tuple[int, ...]
    logprobs: tuple[SampleLogprobs, ...]


# Where the engines of `served_engine` keep the shipped registry's KV snapshots: the session's
# first such engine prefills the 1,936 registry tokens (~4 s on a 2-core AVX2 CPU) and writes
# them; the next ones (a dozen across the modules) read them back in ~0.1 s. A restored
# prefix has the bits of a computed one (tests/e2e/test_smollm2_restart.py and
# tests/engine/test_kv_snapshots.py check that), so no answer here depends on which engine
# filled it. Set by `_shared_registry_snapshots`.
_registry_snapshots: list[Path] = []


@pytest.fixture(scope="session", autouse=True)
def _shared_registry_snapshots(tmp_path_factory: pytest.TempPathFactory) -> None:
    _registry_snapshots[:] = [tmp_path_factory.mktemp("e2e-registry-kv")]


def served_engine(source: ModelSource, **overrides: Any) -> LLMEngine:
    """An in-process engine on the GGUF itself, as `prefixgate serve` serves the embedded
    model (its own Q4_1 blocks), with the shipped prefixes and the block accounting checked
    every step: its converted folder would be served with dense float weights
    (`--quantization none`), whose oneDNN GEMMs are not batch invariant
    (docs/architecture.md).

    The registry's KV comes from the session's shared snapshots where an earlier engine of
    the same identity wrote them; no hot set is kept (budget 0), so the automatic cache of
    each engine starts empty whatever ran before."""
    assert source.gguf_path is not None
    settings: dict[str, Any] = {
        "model": str(source.gguf_path),
        "kv_cache_memory": 256 << 20,
        "max_model_len": 2048,
        "prefix_file": str(SHIPPED_PREFIXES),
        "debug_check_integrity": True,
        "kv_snapshot_dir": str(_registry_snapshots[0]),
        "kv_snapshot_budget": 0,
    }
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def run_requests(
    engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams, int]]
) -> dict[str, Answer]:
    """Add each (id, prompt, params, arrival step) before its step; step to the end."""
    tokens: dict[str, list[int]] = {rid: [] for rid, *_ in requests}
    logprobs: dict[str, list[SampleLogprobs]] = {rid: [] for rid, *_ in requests}
    last = max(arrival for *_, arrival in requests)
    step = 0
    while step <= last or engine.has_unfinished_requests():
        for rid, prompt, params, arrival in requests:
            if arrival == step:
                engine.add_request(rid, prompt, params)
        for output in engine.step():
            tokens[output.request_id] += output.token_ids
            logprobs[output.request_id] += output.logprobs or []
        step += 1
    engine.check_integrity()
    return {rid: Answer(tuple(tokens[rid]), tuple(logprobs[rid])) for rid in tokens}


def registry_chat(engine: LLMEngine, name: str, question: str) -> list[int]:
    """Registry entry `name`'s messages continued by one user turn, rendered for the model:
    a prompt that hits the entry."""
    [spec] = [s for s in engine.prefixes.specs if s.name == name]
    history = [{"role": role, "content": content} for role, content in spec.messages]
    return chat_prompt_ids(engine.tokenizer, [*history, {"role": "user", "content": question}])


def question_prompts(tokenizer: Any) -> list[list[int]]:
    """Each of QUESTIONS as one user turn, rendered with the generation prompt."""
    return [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerFactory]:
    factory = ServerFactory(tmp_path_factory.mktemp("real-server-logs"))
    yield factory
    factory.close()


@pytest.fixture(scope="session")
def real_server(servers: ServerFactory, smollm2_source: ModelSource) -> Server:
    return servers(
        "--prefixes", str(SHIPPED_PREFIXES), ready_timeout=REAL_READY_TIMEOUT, name="real"
    )


@pytest.fixture
def sdk(real_server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{real_server.url}/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id
