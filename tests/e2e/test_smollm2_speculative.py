"""Speculative decoding on the real default model as served (the GGUF's own Q4_1 blocks, the
shipped prefixes.yaml): greedy answers with drafts are the answers without, token for token,
alone, all at once, from the caches and preempted, and drafts are taken and kept (the model
copies from its prompts and repeats itself; intent answers repeat across requests)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine import GrammarSpec, LLMEngine, SamplingParams
from engine.loading.source import ModelSource
from tests.e2e.conftest import question_prompts, registry_chat, run_requests, served_engine
from tests.e2e.test_smollm2_invariance import CUSTOMER_MESSAGES, SUPPORT_QUESTIONS

pytestmark = pytest.mark.e2e

GREEDY = SamplingParams(temperature=0, max_tokens=40)


def _engine(source: ModelSource, **overrides: Any) -> LLMEngine:
    engine = served_engine(source, **overrides)
    # Every draft taken (the step cost model never counts as fitted): the most drafts to
    # verify, and no dependence on this machine's timings
    engine.scheduler.pacing.cost.min_observations = 2**62
    return engine


@pytest.fixture(scope="module")
def served(smollm2_source: ModelSource) -> LLMEngine:
    return _engine(smollm2_source, speculative="off")


@pytest.fixture(scope="module")
def prompts(served: LLMEngine) -> list[list[int]]:
    engine = served
    return [
        *(registry_chat(engine, "intent-classifier", m) for m in CUSTOMER_MESSAGES),
        *(registry_chat(engine, "support-assistant", q) for q in SUPPORT_QUESTIONS),
        *question_prompts(engine.tokenizer),
    ]


@pytest.fixture(scope="module")
def without_drafts(smollm2_source: ModelSource, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    engine = _engine(smollm2_source, speculative="off", enable_auto_prefix_cache=False)
    answers = []
    for i, prompt in enumerate(prompts):
        [answer] = run_requests(engine, [(f"r{i}", prompt, GREEDY, 0)]).values()
        answers.append(answer.token_ids)
    assert engine.scheduler.num_draft_tokens == 0
    return answers


def test_answers_with_drafts_are_the_answers_without(
    smollm2_source: ModelSource, prompts: list[list[int]], without_drafts: list[tuple[int, ...]]
) -> None:
    engine = _engine(smollm2_source)
    alone = [
        run_requests(engine, [(f"a{i}", p, GREEDY, 0)])[f"a{i}"].token_ids
        for i, p in enumerate(prompts)
    ]
    assert alone == without_drafts
    rng = random.Random(0)
    together = run_requests(
        engine, [(f"t{i}", p, GREEDY, rng.randint(0, 8)) for i, p in enumerate(prompts)]
    )
    assert [together[f"t{i}"].token_ids for i in range(len(prompts))] == without_drafts
    counts = engine.drafter.counts()
    assert counts["intent-classifier"].accepted > 0  # from earlier answers and the prompt
    assert counts["support-assistant"].accepted > 0
    assert counts[""].accepted > 0  # plain chats: the model repeating itself
    assert engine.num_accepted_draft_tokens < engine.scheduler.num_draft_tokens
    assert_all_free_but_registry(engine)


def test_preempted_with_drafts_the_answers_are_the_same(
    smollm2_source: ModelSource,
    served: LLMEngine,
    prompts: list[list[int]],
    without_drafts: list[tuple[int, ...]],
) -> None:
    # Room past the registry's pins for the longest request, every prompt twice at once: as
    # they grow, running ones are preempted (some with drafts scheduled) and recomputed
    max_model_len = max(len(p) for p in prompts) + 40
    room = -(-max_model_len // served.pool.block_size)
    engine = _engine(
        smollm2_source,
        kv_cache_memory=None,
        num_kv_blocks=served.pool.num_pinned_blocks + room,
        max_model_len=max_model_len,
    )
    requests = [(f"p{i}.{c}", p, GREEDY, c) for c in (0, 1) for i, p in enumerate(prompts)]
    answers = run_requests(engine, requests)
    for c in (0, 1):
        assert [answers[f"p{i}.{c}"].token_ids for i in range(len(prompts))] == without_drafts
    assert engine.scheduler.num_preemptions > 0
    assert engine.num_accepted_draft_tokens > 0


def test_stop_strings_end_answers_with_drafts_where_they_end_without(
    smollm2_source: ModelSource, prompts: list[list[int]]
) -> None:
    """Stop strings the answers reach (a sentence's end, a line break): asked twice, the
    second time drafted from the first answers, a kept run may pass a stop in one step; the
    answer still ends at the token that completes it."""
    params = SamplingParams(temperature=0, max_tokens=40, stop=(". ", "\n"))
    off = _engine(smollm2_source, speculative="off", enable_auto_prefix_cache=False)
    want = [
        run_requests(off, [(f"o{i}", p, params, 0)])[f"o{i}"].token_ids
        for i, p in enumerate(prompts)
    ]
    assert sum(len(answer) < 40 for answer in want) >= len(prompts) // 2  # stopped early
    engine = _engine(smollm2_source)
    for round in ("first", "again"):
        got = run_requests(engine, [(f"{round}{i}", p, params, 0) for i, p in enumerate(prompts)])
        assert [got[f"{round}{i}"].token_ids for i in range(len(prompts))] == want, round
    assert engine.num_accepted_draft_tokens > 0
    assert_all_free_but_registry(engine)


def test_constrained_answers_with_drafts_are_the_answers_without(
    smollm2_source: ModelSource, served: LLMEngine
) -> None:
    """The intent entry under its own label schema, and support questions under a schema
    whose strings copy from the policy: asked twice (the second time drafted from the first
    answers and the prompt, only tokens the grammar allows), the answers are those without
    drafts, token for token."""
    [intent] = [s for s in served.prefixes.specs if s.name == "intent-classifier"]
    assert intent.contract is not None and intent.contract.grammar is not None
    quote = GrammarSpec.json_schema(
        {
            "type": "object",
            "properties": {"quote": {"type": "string", "maxLength": 160}},
            "required": ["quote"],
            "additionalProperties": False,
        }
    )
    requests = [
        *(
            (registry_chat(served, "intent-classifier", m), intent.contract.grammar)
            for m in CUSTOMER_MESSAGES
        ),
        *(
            (registry_chat(served, "support-assistant", f"Quote the policy on this: {q}"), quote)
            for q in SUPPORT_QUESTIONS
        ),
    ]
    params = [SamplingParams(temperature=0, max_tokens=60, grammar=g) for _, g in requests]
    off = _engine(smollm2_source, speculative="off", enable_auto_prefix_cache=False)
    want = [
        run_requests(off, [(f"o{i}", p, params[i], 0)])[f"o{i}"].token_ids
        for i, (p, _) in enumerate(requests)
    ]
    engine = _engine(smollm2_source)
    for round in ("first", "again"):
        got = run_requests(
            engine, [(f"{round}{i}", p, params[i], 0) for i, (p, _) in enumerate(requests)]
        )
        assert [got[f"{round}{i}"].token_ids for i in range(len(requests))] == want, round
    assert engine.num_accepted_draft_tokens > 0
    assert_all_free_but_registry(engine)


def assert_all_free_but_registry(engine: LLMEngine) -> None:
    engine.check_integrity()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - engine.pool.num_pinned_blocks
