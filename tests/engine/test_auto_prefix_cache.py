"""Automatic prefix caching (tiny Llama, 4-token blocks): repeats, chat turns and near misses
reuse every full block computed before, in their own cache scope only; outputs are exactly
those of the engine with caching off, at batch 1, in mixed batches, across evictions and
preemptions; a seeded random walk of admit / abort / preempt / evict keeps the invariants
after every step."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLMEngine, SamplingParams
from tests.helpers import assert_all_free, run_staggered, tiny_engine, tokens_of

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 200) for _ in range(length)]


def _generate(engine: LLMEngine, prompt: list[int], **params: object) -> tuple[list[int], int]:
    """(output tokens, cached tokens) of one request run alone."""
    sampling = SamplingParams(**{"temperature": 0, "max_tokens": 8, "ignore_eos": True, **params})  # type: ignore[arg-type]
    [outputs] = run_staggered(engine, [prompt], sampling, [0])
    return tokens_of(outputs), outputs[-1].num_cached_tokens


def _full_blocks(num_tokens: int) -> int:
    return num_tokens // BLOCK * BLOCK


@pytest.fixture
def engine(tiny_llama_path: Path) -> LLMEngine:
    return tiny_engine(tiny_llama_path, max_model_len=256)


@pytest.fixture
def plain(tiny_llama_path: Path) -> LLMEngine:
    return tiny_engine(tiny_llama_path, max_model_len=256, enable_prefix_cache=False)


def test_a_repeated_prompt_reuses_every_full_block_but_the_last_token(
    engine: LLMEngine, plain: LLMEngine
) -> None:
    prompt = _prompt(1, 30)
    first, cached_first = _generate(engine, prompt)
    again, cached_again = _generate(engine, prompt)
    assert cached_first == 0
    assert cached_again == _full_blocks(len(prompt) - 1)  # the last token gives the logits
    assert first == again == _generate(plain, prompt)[0]
    assert_all_free(engine)


def _written(
    engine: LLMEngine, prompt: list[int], cache_salt: str | None = None
) -> tuple[int, int]:
    """(cached, written) prompt tokens of one request run alone: what it read from the cache
    and what of its prompt it put there (the Responses API's cache_write_tokens)."""
    sampling = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_prepared("w", engine.prepare_request(prompt, sampling, cache_salt))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs[-1].num_cached_tokens, outputs[-1].num_cache_written_tokens


def test_a_request_counts_the_prompt_tokens_it_put_in_the_cache(
    engine: LLMEngine, tiny_llama_path: Path
) -> None:
    """A first prompt writes its full blocks; the same again writes none; one that extends it
    writes only its new full blocks (its answer's blocks are not prompt tokens); another
    scope holds none of them; with the automatic cache off nothing is written."""
    prompt = _prompt(4, 30)
    assert _written(engine, prompt) == (0, 28)
    assert _written(engine, prompt) == (28, 0)
    assert _written(engine, prompt + _prompt(5, 9)) == (28, 36 - 28)
    assert _written(engine, prompt, cache_salt="other") == (0, 28)
    off = tiny_engine(tiny_llama_path, max_model_len=256, enable_auto_prefix_cache=False)
    assert _written(off, prompt) == (0, 0)
    # Two prompts that share a fresh prefix, computed in the same steps: the prefix is
    # written once between them, each tail by its own.
    shared = _prompt(6, 28)
    pair = [shared + _prompt(7, 10), shared + _prompt(8, 10)]
    outputs = run_staggered(engine, pair, SamplingParams(temperature=0, max_tokens=2), [0, 0])
    counts = [(o[-1].num_cached_tokens, o[-1].num_cache_written_tokens) for o in outputs]
    assert sum(written for _, written in counts) == 28 + 2 * 8
    assert_all_free(engine)


def test_the_next_chat_turn_reuses_the_previous_prompt_and_answer(
    engine: LLMEngine, plain: LLMEngine
) -> None:
    turn1 = _prompt(2, 21)
    answer, _ = _generate(engine, turn1)
    turn2 = turn1 + answer + _prompt(3, 9)
    reply, cached = _generate(engine, turn2)
    # Turn 1 computed its prompt and all of its answer but the last token (never fed back).
    assert cached == _full_blocks(len(turn1) + len(answer) - 1)
    assert reply == _generate(plain, turn2)[0]


def test_a_near_miss_shares_the_blocks_before_the_difference(
    engine: LLMEngine, plain: LLMEngine
) -> None:
    prompt = _prompt(4, 40)
    _generate(engine, prompt)
    for position in (0, 3, 4, 17, 35):
        changed = list(prompt)
        changed[position] = 201 + position
        tokens, cached = _generate(engine, changed)
        assert cached == _full_blocks(position), position
        assert tokens == _generate(plain, changed)[0]


def test_output_is_unchanged_in_mixed_batches(engine: LLMEngine, plain: LLMEngine) -> None:
    base = _prompt(5, 26)
    prompts = [base, base + _prompt(6, 7), base[:13] + _prompt(7, 20), base, _prompt(8, 18)]
    arrivals = [0, 2, 2, 5, 5]
    got = run_staggered(engine, prompts, GREEDY, arrivals)
    want = run_staggered(plain, prompts, GREEDY, arrivals)
    assert [tokens_of(r) for r in got] == [tokens_of(r) for r in want]
    cached = [r[-1].num_cached_tokens for r in got]
    assert cached[0] == 0 and cached[4] == 0
    assert cached[1] >= _full_blocks(len(base)) and cached[3] == _full_blocks(len(base) - 1)
    assert cached[2] == _full_blocks(13)
    assert_all_free(engine)


def test_cache_salts_keep_scopes_apart(engine: LLMEngine) -> None:
    prompt = _prompt(9, 24)
    for salt, expected in (("a", 0), ("b", 0), ("a", 20), (None, 0), (None, 20)):
        request = engine.prepare_request(prompt, GREEDY, salt)
        engine.add_prepared(f"r-{salt}-{expected}", request)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert outputs[-1].num_cached_tokens == expected, (salt, expected)


def test_freed_blocks_stay_cached_until_the_pool_needs_them(
    tiny_llama_path: Path, plain: LLMEngine
) -> None:
    engine = tiny_engine(tiny_llama_path, max_model_len=64, num_kv_blocks=24)
    prompts = [_prompt(10 + i, 30) for i in range(4)]
    for prompt in prompts:  # each needs ~10 blocks: later ones evict earlier ones
        _generate(engine, prompt)
    assert engine.pool.num_evictions > 0
    assert engine.pool.num_cached_blocks <= engine.pool.num_blocks
    tokens, cached = _generate(engine, prompts[-1])  # the newest is still cached
    assert cached == _full_blocks(29)
    assert tokens == _generate(plain, prompts[-1])[0]
    tokens, cached = _generate(engine, prompts[0])  # the oldest was evicted
    assert cached == 0
    assert tokens == _generate(plain, prompts[0])[0]
    assert_all_free(engine)


def test_preempted_sequences_recompute_from_their_cached_blocks(
    tiny_llama_path: Path,
) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [_prompt(20 + i, 30) for i in range(5)]
    # One token a step, so that this pool runs out mid-decode (tests/engine/speculative/
    # preempts with drafts)
    small = tiny_engine(tiny_llama_path, num_kv_blocks=40, max_model_len=96, speculative="off")
    plain = tiny_engine(
        tiny_llama_path,
        num_kv_blocks=40,
        max_model_len=96,
        enable_prefix_cache=False,
        speculative="off",
    )
    got = run_staggered(small, prompts, params, [0] * 5)
    want = run_staggered(plain, prompts, params, [0] * 5)
    assert small.scheduler.num_preemptions > 0
    assert [tokens_of(r) for r in got] == [tokens_of(r) for r in want]
    # A recompute from the sequence's own blocks is not reported as the client's cache hit.
    assert [r[-1].num_cached_tokens for r in got] == [0] * 5
    assert small.runner.num_forward_tokens < plain.runner.num_forward_tokens
    assert_all_free(small)


def test_auto_cache_off_keeps_only_the_registry(tiny_llama_path: Path) -> None:
    engine = tiny_engine(tiny_llama_path, max_model_len=256, enable_auto_prefix_cache=False)
    prompt = _prompt(30, 24)
    _generate(engine, prompt)
    assert _generate(engine, prompt)[1] == 0
    assert engine.pool.num_cached_blocks == 0


def test_random_walk_keeps_the_invariants(tiny_llama_path: Path) -> None:
    """Admit (prompts sharing starts), abort, step, in a pool small enough to preempt and
    evict; the block accounting is checked after every step (debug_check_integrity) and
    every request that finishes equals its run alone with caching off."""
    rng = random.Random(1234)
    engine = tiny_engine(
        tiny_llama_path, num_kv_blocks=20, max_model_len=64, max_num_batched_tokens=16
    )
    plain = tiny_engine(tiny_llama_path, max_model_len=64, enable_prefix_cache=False)
    stems = [_prompt(40 + i, 20) for i in range(3)]
    prompts: dict[str, list[int]] = {}
    finished: dict[str, list[int]] = {}
    produced: dict[str, list[int]] = {}
    for step in range(160):
        if rng.random() < 0.5 and len(prompts) < 40:
            stem = rng.choice(stems)
            prompt = stem[: rng.randrange(3, 21)] + _prompt(
                rng.randrange(1000), rng.randrange(1, 12)
            )
            request_id = f"r{step}"
            prompts[request_id] = prompt
            produced[request_id] = []
            engine.add_request(request_id, prompt, GREEDY)
        live = [r for r in prompts if r not in finished and engine.scheduler.find(r) is not None]
        if live and rng.random() < 0.08:
            victim = rng.choice(live)
            engine.abort_request(victim)
            finished[victim] = []  # aborted: not compared
            del produced[victim]
        for output in engine.step():
            if output.request_id in produced:
                produced[output.request_id] += output.token_ids
                if output.finished:
                    finished[output.request_id] = produced[output.request_id]
    while engine.has_unfinished_requests():
        for output in engine.step():
            produced[output.request_id] += output.token_ids
            if output.finished:
                finished[output.request_id] = produced[output.request_id]
    assert engine.scheduler.num_preemptions > 0 and engine.pool.num_evictions > 0
    compared = [r for r in produced if finished.get(r)]
    assert len(compared) >= 20
    for request_id in compared:
        assert finished[request_id] == _generate(plain, prompts[request_id])[0], request_id
    assert_all_free(engine)
