"""The real default model (SmolLM2-135M-Instruct): our engine == transformers `generate`.

Greedy tokens must be identical, token for token, at batch 1 and in one continuous batch
with different lengths and arrival steps, also with a tiny prefill chunk and with a pool
small enough to force preemption.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, chat_prompt_ids
from engine.loading.source import ModelSource
from tests.e2e.conftest import question_prompts
from tests.helpers import assert_all_free, float_reference, run_staggered, tokens_of

pytestmark = pytest.mark.e2e

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def _engine(source: ModelSource, **overrides: Any) -> LLMEngine:
    settings: dict[str, Any] = {
        "model": str(source.gguf_path),
        "quantization": "none",  # the file's values as float32 weights, as the reference's
        "dtype": "float32",  # token for token against transformers' float32 generate
        "kv_cache_dtype": "float32",
        "kv_cache_memory": 256 << 20,
        "max_model_len": 2048,
        "debug_check_integrity": True,
    }
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


@pytest.fixture(scope="module")
def engine(smollm2_source: ModelSource) -> LLMEngine:
    return _engine(smollm2_source)


@pytest.fixture(scope="module")
def prompts(engine: LLMEngine) -> list[list[int]]:
    return question_prompts(engine.tokenizer)


@pytest.fixture(scope="module")
def expected(smollm2_source: ModelSource, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' own greedy `generate`, one prompt at a time (stops at EOS, keeps it)."""
    model = float_reference(smollm2_source)
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS
        )
        results.append([int(t) for t in out[0, len(prompt) :]])
    return results


def test_greedy_equals_transformers_generate_at_batch_1(
    engine: LLMEngine, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    for prompt, want in zip(prompts, expected, strict=True):
        assert engine.generate([prompt], GREEDY) == [want]
    assert_all_free(engine)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="continuous-batch"),
        pytest.param({"max_num_batched_tokens": 16}, id="chunked-prefill-16"),
        pytest.param({"num_kv_blocks": 12, "max_model_len": 128}, id="preemption"),
    ],
)
def test_greedy_equals_transformers_generate_in_a_staggered_batch(
    smollm2_source: ModelSource,
    engine: LLMEngine,
    prompts: list[list[int]],
    expected: list[list[int]],
    overrides: dict[str, Any],
) -> None:
    target = _engine(smollm2_source, **overrides) if overrides else engine
    results = run_staggered(target, prompts, GREEDY, arrivals=[0, 0, 3, 7, 12])
    assert [tokens_of(r) for r in results] == expected
    if "num_kv_blocks" in overrides:
        assert target.scheduler.num_preemptions > 0
    assert_all_free(target)


def test_capital_of_france(engine: LLMEngine, prompts: list[list[int]]) -> None:
    [outputs] = run_staggered(engine, prompts[:1], GREEDY, [0])
    text = "".join(o.text for o in outputs)
    assert "Paris" in text
    assert outputs[-1].finish_reason == "stop"
    assert "<|im_end|>" not in text


def test_streamed_text_is_whole_utf8_and_equals_decode(engine: LLMEngine) -> None:
    """Japanese output: most characters span several byte-level tokens."""
    prompt = chat_prompt_ids(
        engine.tokenizer, [{"role": "user", "content": "Translate 'thank you' into Japanese."}]
    )
    [outputs] = run_staggered(
        engine, [list(prompt)], SamplingParams(temperature=0, max_tokens=40), [0]
    )
    tokens = tokens_of(outputs)
    split = [t for t in tokens if "\ufffd" in engine.tokenizer.decode([t])]
    assert len(split) >= 10, "the output should have characters spread over several tokens"
    assert all("\ufffd" not in o.text for o in outputs)
    assert "".join(o.text for o in outputs) == engine.tokenizer.decode(
        tokens, skip_special_tokens=True
    )
