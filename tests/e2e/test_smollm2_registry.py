"""The shipped prefixes.yaml on the real default model: a registry hit changes nothing but time.

Greedy tokens with the registry == with caching off == transformers `generate` on the full
prompt, for every shipped prefix, at batch 1 and in one mixed continuous batch (hits, a
miss, an exact hit), and the usage counts are exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, chat_prompt_ids, text_prompt_ids
from engine.loading.source import ModelSource
from tests.e2e.conftest import registry_chat
from tests.helpers import float_reference, run_staggered, tokens_of

pytestmark = pytest.mark.e2e

PREFIXES = Path(__file__).resolve().parents[2] / "prefixes.yaml"
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def _engine(source: ModelSource, cached: bool) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(source.gguf_path),
            quantization="none",  # the file's values as float32 weights, as the reference's
            dtype="float32",  # hits equal recomputation token for token
            kv_cache_memory=512 << 20,
            max_model_len=2048,
            prefix_file=str(PREFIXES),
            enable_prefix_cache=cached,
            debug_check_integrity=True,
        )
    )


@pytest.fixture(scope="module")
def registry_engine(smollm2_source: ModelSource) -> LLMEngine:
    return _engine(smollm2_source, cached=True)


@pytest.fixture(scope="module")
def plain_engine(smollm2_source: ModelSource) -> LLMEngine:
    return _engine(smollm2_source, cached=False)


@pytest.fixture(scope="module")
def cases(registry_engine: LLMEngine) -> dict[str, tuple[list[int], str | None]]:
    """prompt ids and the prefix each should hit (None: a miss)."""
    tok = registry_engine.tokenizer
    specs = {s.name: s for s in registry_engine.prefixes.specs}

    def chat(name: str, question: str) -> list[int]:
        return registry_chat(registry_engine, name, question)

    doc = specs["doc-qa"]
    return {
        "intent": (
            chat("intent-classifier", "My parcel 55123 never arrived, where is it?"),
            "intent-classifier",
        ),
        "support": (
            chat("support-assistant", "How do I share a folder with my team?"),
            "support-assistant",
        ),
        "doc": (text_prompt_ids(tok, doc.text + " Can I get a refund?\nAnswer:"), "doc-qa"),
        "miss": (chat_prompt_ids(tok, [{"role": "user", "content": "Name three colours."}]), None),
        "exact": (list(doc.token_ids), "doc-qa"),
    }


@pytest.fixture(scope="module")
def expected(smollm2_source: ModelSource, cases: dict[str, Any]) -> dict[str, list[int]]:
    model = float_reference(smollm2_source)
    results = {}
    for name, (prompt, _) in cases.items():
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS
        )
        results[name] = [int(t) for t in out[0, len(prompt) :]]
    return results


def test_every_shipped_prefix_is_registered(registry_engine: LLMEngine) -> None:
    assert sorted(registry_engine.registry.prefixes) == [
        "doc-qa",
        "intent-classifier",
        "support-assistant",
    ]
    assert 850 <= registry_engine.registry.prefixes["intent-classifier"].num_tokens <= 1000


def test_batch_1_equals_caching_off_and_transformers(
    registry_engine: LLMEngine,
    plain_engine: LLMEngine,
    cases: dict[str, Any],
    expected: dict[str, list[int]],
) -> None:
    for name, (prompt, prefix) in cases.items():
        [hit] = run_staggered(registry_engine, [prompt], GREEDY, [0])
        [plain] = run_staggered(plain_engine, [prompt], GREEDY, [0])
        assert tokens_of(hit) == tokens_of(plain) == expected[name], name
        cached = registry_engine.registry.prefixes[prefix].num_tokens if prefix else 0
        assert (hit[-1].num_cached_tokens, plain[-1].num_cached_tokens) == (cached, 0), name
        assert hit[-1].num_prompt_tokens == len(prompt)


def test_mixed_continuous_batch_equals_caching_off(
    registry_engine: LLMEngine,
    plain_engine: LLMEngine,
    cases: dict[str, Any],
    expected: dict[str, list[int]],
) -> None:
    prompts = [prompt for prompt, _ in cases.values()]
    arrivals = [0, 0, 1, 2, 2]
    hit = run_staggered(registry_engine, prompts, GREEDY, arrivals)
    plain = run_staggered(plain_engine, prompts, GREEDY, arrivals)
    assert [tokens_of(r) for r in hit] == [tokens_of(r) for r in plain] == list(expected.values())
    registry_engine.check_integrity()
    pinned = registry_engine.pool.num_pinned_blocks
    assert registry_engine.pool.num_free_blocks + pinned == registry_engine.pool.num_blocks
