"""Structured outputs on the real default model: 60 generated JSON schemas (nested objects,
arrays, enums, bounded numbers, optional fields, anyOf), greedy, in one continuous batch;
every output must end by itself and validate against its schema."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

from engine import EngineConfig, GrammarSpec, LLMEngine, SamplingParams, chat_prompt_ids
from engine.loading.source import ModelSource
from tests.helpers import assert_all_free

pytestmark = pytest.mark.e2e

NUM_SCHEMAS = 60  # 100 took 43 s of a 15-minute CI budget; 60 keep every schema kind
MAX_TOKENS = 320
WORDS = ["red", "green", "blue", "small", "large", "open", "closed", "north", "south", "cat"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema whose every value is bounded, so a valid answer is always short."""
    names = rng.sample(["id", "name", "kind", "size", "tags", "owner", "score", "info"], 4)
    properties = {name: _value(rng, depth) for name in names[: rng.randint(1, 4)]}
    required = [name for name in properties if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "enum", "integer", "number", "boolean", "array", "anyOf"]
    kinds += ["object"] if depth < 2 else []
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(3, 12)}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 4))}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 500)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 100])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        item = rng.choice([{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": WORDS[:3]}])
        return {"type": "array", "items": item, "minItems": 1, "maxItems": rng.randint(1, 3)}
    if kind == "anyOf":
        integer = {"type": "integer", "minimum": 0, "maximum": 999}
        return {"anyOf": [{"type": "string", "maxLength": 6}, integer]}
    return random_schema(rng, depth + 1)


def _engine(source: ModelSource, **overrides: Any) -> LLMEngine:
    """The GGUF itself, as the server serves the embedded model: its own Q4_1 blocks on the
    C++ kernels, where a position's bits do not depend on the batch (the converted folder's
    dense float weights make no such promise)."""
    assert source.gguf_path is not None
    return LLMEngine(
        EngineConfig(
            model=str(source.gguf_path),
            kv_cache_memory=512 << 20,
            max_model_len=2048,
            max_num_seqs=32,
            **overrides,
        )
    )


@pytest.fixture(scope="module")
def engine(smollm2_source: ModelSource) -> LLMEngine:
    return _engine(smollm2_source)


def _schemas(n: int) -> list[dict[str, Any]]:
    rng = random.Random(20261123)
    return [random_schema(rng) for _ in range(n)]


def _answers(
    engine: LLMEngine, schemas: list[dict[str, Any]]
) -> tuple[list[list[int]], list[str | None]]:
    """Each schema's greedy answer (tokens, finish reason), all in one continuous batch."""
    for i, schema in enumerate(schemas):
        question = (
            f"Reply with one JSON object that matches this JSON schema:\n{json.dumps(schema)}"
        )
        prompt = chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": question}])
        params = SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, grammar=GrammarSpec.json_schema(schema)
        )
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(schemas))}
    finish: dict[str, str | None] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] += output.token_ids
            finish[output.request_id] = output.finish_reason
    assert_all_free(engine)
    return [tokens[str(i)] for i in range(len(schemas))], [
        finish[str(i)] for i in range(len(schemas))
    ]


def test_sixty_generated_schemas_all_validate(engine: LLMEngine) -> None:
    schemas = _schemas(NUM_SCHEMAS)
    tokens, finish = _answers(engine, schemas)
    texts = [engine.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    unfinished = [(i, texts[i]) for i in range(NUM_SCHEMAS) if finish[i] != "stop"]
    assert unfinished == []
    for schema, text in zip(schemas, texts, strict=True):
        jsonschema.validate(json.loads(text), schema)


def test_forced_tokens_without_their_own_steps_give_the_same_answers(
    engine: LLMEngine, smollm2_source: ModelSource
) -> None:
    """Grammar fast-forward on the real model and tokenizer: the keys, punctuation and enum
    tails a schema forces join without a decode step each, and every answer is the answer
    one step a token gives, in a batch whose shapes differ from that one's at every step."""
    schemas = _schemas(24)
    off = _engine(smollm2_source, enable_grammar_fast_forward=False)
    forced_before, steps_before = engine.num_forced_tokens, engine.num_steps
    expected = _answers(off, schemas)
    assert _answers(engine, schemas) == expected
    num_forced = engine.num_forced_tokens - forced_before
    assert off.num_forced_tokens == 0 and num_forced >= sum(map(len, expected[0])) // 5
    assert engine.num_steps - steps_before < off.num_steps / 2
