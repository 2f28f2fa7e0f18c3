"""Same request, same answer, on the real default model as served (embedded Q4_1 weights, the
default dtype and kernels, the shipped prefixes.yaml).

Twenty requests are first answered one at a time by an engine that caches nothing; then on
engines that serve them among other requests: all at once, at random arrival steps, after
other prompts filled the automatic cache with part of theirs, again once every prompt is
cached (exact hits), with two copies of some in the same step (n > 1), in prefill chunks of
several sizes, and in a pool so small that running requests are preempted and recomputed.
Every answer's tokens and logprobs (the sampled token's and the top 3) must be bit-identical
to the request's lone answer, greedy and seeded at temperature 0.8 alike, and greedy with a
`logit_bias` (half of the twenty: their lone greedy answer's first token banned, another
favoured).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine import LLMEngine, SamplingParams, chat_prompt_ids, text_prompt_ids
from engine.loading.source import ModelSource
from tests.e2e.conftest import Answer, registry_chat, run_requests, served_engine
from tests.helpers import assert_all_free

pytestmark = pytest.mark.e2e

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3)
CUSTOMER_MESSAGES = [
    "I want to export all my photos to a zip file, how?",
    "My parcel 55123 never arrived, where is it?",
    "why was i charged twice this month??",
    "The desktop app crashes whenever I open the Photos tab.",
    "Someone logged into my account from Brazil, I never go there.",
    "Please cancel my plan and stop charging my card.",
    "Can I move from 2 TB to 5 TB without losing files?",
    "mi carpeta no se sincroniza desde ayer",
]
SUPPORT_QUESTIONS = [
    "How do I share a folder with my team?",
    "My files stopped syncing on my phone, what should I check?",
    "Is there a way to restore a file I deleted yesterday?",
]
DOC_QUESTIONS = [" Can I get a refund?\nAnswer:", " How long are deleted files kept?\nAnswer:"]
CHAT_QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each one is prime.",
    "Explain gravity in one sentence to a child who is five years old and likes dinosaurs.",
    "Hi",
]
# Prompts that share the first blocks of some of the twenty: run before them, they put those
# blocks into the automatic cache, so the twenty then start from partial hits.
WARMUP_QUESTIONS = [
    "List three prime numbers and explain why each one is odd.",
    "Explain gravity in one sentence to a child who is five years old and likes cats.",
]


@pytest.fixture(scope="module")
def served(smollm2_source: ModelSource) -> LLMEngine:
    return served_engine(smollm2_source)


@pytest.fixture(scope="module")
def prompts(served: LLMEngine) -> list[list[int]]:
    """The twenty: registry hits of each shipped prefix, a whole registered prefix (an exact
    hit), plain chats."""
    tok = served.tokenizer
    [doc] = [s for s in served.prefixes.specs if s.name == "doc-qa"]
    return [
        *(registry_chat(served, "intent-classifier", m) for m in CUSTOMER_MESSAGES),
        *(registry_chat(served, "support-assistant", q) for q in SUPPORT_QUESTIONS),
        *(text_prompt_ids(tok, doc.text + q) for q in DOC_QUESTIONS),
        list(doc.token_ids),
        *(_plain(tok, q) for q in CHAT_QUESTIONS),
        _plain(tok, "Name three colours."),
    ]


def _plain(tok: Any, question: str) -> list[int]:
    return chat_prompt_ids(tok, [{"role": "user", "content": question}])


def _seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=MAX_TOKENS, logprobs=3)


def _biased(i: int, greedy: Answer) -> SamplingParams | None:
    """Odd-numbered requests (the exact hit among them): greedy with the lone greedy answer's
    first token banned and its second favoured by 3 (`alone` checks the answer moved)."""
    if i % 2 == 0:
        return None
    first, *rest = greedy.token_ids
    bias = ((first, -100.0), *((t, 3.0) for t in rest[:1] if t != first))
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3, logit_bias=bias)


@pytest.fixture(scope="module")
def alone(smollm2_source: ModelSource, prompts: list[list[int]]) -> dict[str, Answer]:
    """Each request by itself, greedy ("g<i>") and seeded ("s<i>"), on an engine with the
    registry but no automatic cache (`test_alone_is_alone_without_any_cache` checks that the
    registry changes nothing)."""
    engine = served_engine(smollm2_source, enable_auto_prefix_cache=False)
    answers: dict[str, Answer] = {}
    for i, prompt in enumerate(prompts):
        answers.update(run_requests(engine, [(f"g{i}", prompt, GREEDY, 0)]))
        answers.update(run_requests(engine, [(f"s{i}", prompt, _seeded(i), 0)]))
        if (biased := _biased(i, answers[f"g{i}"])) is not None:
            answers.update(run_requests(engine, [(f"b{i}", prompt, biased, 0)]))
            assert answers[f"b{i}"].token_ids[0] != answers[f"g{i}"].token_ids[0]
    assert all(len(a.token_ids) > 0 for a in answers.values())
    return answers


def _mix(
    prompts: list[list[int]],
    alone: dict[str, Answer],
    rng: random.Random,
    spread: int,
    copies: int = 1,
) -> list[tuple[str, list[int], SamplingParams, int]]:
    """The twenty, greedy, seeded and (half) biased, `copies` of each of a random third
    (n > 1), at random arrival steps in [0, spread], in random order."""
    doubled = set(rng.sample(range(len(prompts)), len(prompts) // 3))
    requests = []
    for i, prompt in enumerate(prompts):
        for copy in range(copies if i in doubled else 1):
            arrival = rng.randint(0, spread)
            requests.append((f"g{i}.{copy}", prompt, GREEDY, arrival))
            requests.append((f"s{i}.{copy}", prompt, _seeded(i), rng.randint(0, spread)))
            if (biased := _biased(i, alone[f"g{i}"])) is not None:
                requests.append((f"b{i}.{copy}", prompt, biased, rng.randint(0, spread)))
    rng.shuffle(requests)
    return requests


def _assert_same(answers: dict[str, Answer], alone: dict[str, Answer]) -> None:
    differ = [rid for rid, answer in answers.items() if answer != alone[rid.split(".")[0]]]
    assert not differ, f"{len(differ)} of {len(answers)} answers differ from alone: {differ}"


def test_alone_is_alone_without_any_cache(
    smollm2_source: ModelSource, prompts: list[list[int]], alone: dict[str, Answer]
) -> None:
    """The control: a registry hit of each kind, the exact hit and a plain chat, alone on an
    engine that caches nothing, then twice alone on a serving engine (registry and automatic
    cache: the second time from the cache)."""
    cases = (0, 8, 11, 13, 14)
    uncached = served_engine(smollm2_source, prefix_file=None, enable_prefix_cache=False)
    for i in cases:
        _assert_same(run_requests(uncached, [(f"g{i}", prompts[i], GREEDY, 0)]), alone)
    assert_all_free(uncached)
    serving = served_engine(smollm2_source)
    for i in cases:
        _assert_same(run_requests(serving, [(f"g{i}", prompts[i], GREEDY, 0)]), alone)
        _assert_same(run_requests(serving, [(f"g{i}", prompts[i], GREEDY, 0)]), alone)


def test_all_at_once_with_duplicates_then_cached_at_random_steps(
    served: LLMEngine, prompts: list[list[int]], alone: dict[str, Answer]
) -> None:
    tok = served.tokenizer
    warmup = [(f"w{i}", _plain(tok, q), GREEDY, 0) for i, q in enumerate(WARMUP_QUESTIONS)]
    run_requests(served, warmup)
    rng = random.Random(24)
    _assert_same(run_requests(served, _mix(prompts, alone, rng, spread=0, copies=2)), alone)
    # every prompt is in the automatic cache now: exact hits, at random steps
    _assert_same(run_requests(served, _mix(prompts, alone, rng, spread=30, copies=2)), alone)


# and the default 128 above; tests/engine/test_batch_invariance.py runs chunks of 7, 64 and 128
@pytest.mark.parametrize("budget", [48])
def test_chunked_prefill_at_random_steps(
    smollm2_source: ModelSource,
    prompts: list[list[int]],
    alone: dict[str, Answer],
    budget: int,
) -> None:
    engine = served_engine(smollm2_source, max_num_batched_tokens=budget)
    _assert_same(
        run_requests(engine, _mix(prompts, alone, random.Random(budget), spread=40)), alone
    )


def test_preempted_and_recomputed(
    smollm2_source: ModelSource,
    served: LLMEngine,
    prompts: list[list[int]],
    alone: dict[str, Answer],
) -> None:
    """A pool that holds the pinned prefixes and one longest request: the rest wait, and
    running ones are preempted as they grow."""
    block_size = served.pool.block_size
    max_model_len = max(len(p) for p in prompts) + MAX_TOKENS
    room = -(-max_model_len // block_size)  # the least the pool may leave past the pins
    engine = served_engine(
        smollm2_source,
        num_kv_blocks=served.pool.num_pinned_blocks + room,
        kv_cache_memory=None,
        max_model_len=max_model_len,
    )
    _assert_same(run_requests(engine, _mix(prompts, alone, random.Random(7), spread=10)), alone)
    assert engine.scheduler.num_preemptions > 0
