"""Pacing: the step cost model fits a machine's steps; prompt chunks beside decodes fit the
target, a step without decodes keeps its whole budget, and waiting prompts always progress."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from engine.kvcache.block_pool import BlockPool, KVCacheSpec
from engine.kvcache.manager import KVCacheManager
from engine.scheduler.pacing import Histogram, Pacing, StepCostModel, attention_keys
from engine.scheduler.scheduler import Scheduler, SchedulerOutput

# A made-up machine: 10 ms a step, 3 ms a token, 0.5 ms per 1000 keys read.
BASE, PER_TOKEN, PER_KILOKEY = 0.010, 0.003, 0.0005


def _seconds(tokens: int, keys: int) -> float:
    return BASE + PER_TOKEN * tokens + PER_KILOKEY * keys / 1000


def _fitted(num_steps: int = 40, seed: int = 0) -> StepCostModel:
    """Fed decode steps of 1-32 rows and mixed steps with prompt chunks."""
    rng = random.Random(seed)
    model = StepCostModel()
    for _ in range(num_steps):
        decodes = rng.randint(1, 32)
        chunk = rng.choice([0, 0, 16, 48, 128])
        keys = decodes * rng.randint(50, 1500) + attention_keys(rng.randint(0, 900), chunk)
        model.observe(decodes + chunk, keys, _seconds(decodes + chunk, keys))
    return model


def test_attention_keys_count_every_causal_read() -> None:
    assert attention_keys(0, 1) == 1
    assert attention_keys(10, 1) == 11  # a decode at position 10 reads keys 0..10
    assert attention_keys(4, 3) == 5 + 6 + 7


def test_the_cost_model_learns_the_machine() -> None:
    model = _fitted()
    assert model.is_ready
    for tokens, keys in [(1, 900), (32, 32 * 1000), (160, 70_000), (8, 100)]:
        assert model.seconds(tokens, keys) == pytest.approx(_seconds(tokens, keys), rel=1e-3)


def test_the_cost_model_follows_a_machine_that_slows_down() -> None:
    model = _fitted()
    rng = random.Random(1)
    for _ in range(200):  # the machine is now twice as slow
        tokens, keys = rng.randint(1, 160), rng.randint(100, 100_000)
        model.observe(tokens, keys, 2 * _seconds(tokens, keys))
    assert model.seconds(40, 30_000) == pytest.approx(2 * _seconds(40, 30_000), rel=1e-2)


def test_steady_decode_steps_keep_the_model_bounded() -> None:
    """Thousands of identical steps (one steady batch) must not blow up its variance."""
    model = _fitted()
    for _ in range(5000):
        model.observe(8, 8 * 500, _seconds(8, 8 * 500))
    assert max(model.p[i][i] for i in range(3)) <= 1e3
    assert model.seconds(100, 50_000) == pytest.approx(_seconds(100, 50_000), rel=1e-2)


def _pacing(max_itl: float | None = 0.150, floor: int = 16) -> Pacing:
    return Pacing(max_itl, min_prefill_tokens=floor, cost=_fitted())


def test_a_chunk_is_the_largest_that_fits_the_time_left() -> None:
    pacing = _pacing()
    time_left = pacing.time_left(num_decodes=8, decode_keys=8 * 800)
    assert time_left == pytest.approx(0.150 - _seconds(8, 8 * 800), rel=1e-3)
    assert time_left is not None
    k = pacing.chunk(time_left, start=300, wanted=500, prefilled=0)
    fits = PER_TOKEN * k + PER_KILOKEY * attention_keys(300, k) / 1000
    more = PER_TOKEN * (k + 1) + PER_KILOKEY * attention_keys(300, k + 1) / 1000
    assert fits <= time_left * (1 + 1e-3) and more > time_left * (1 - 1e-3)
    assert 16 < k < 500
    assert pacing.chunk(time_left, start=300, wanted=10, prefilled=0) == 10  # all it has left


def test_no_decodes_no_target_or_no_model_means_no_limit() -> None:
    assert _pacing().time_left(num_decodes=0, decode_keys=0) is None
    assert _pacing(max_itl=None).time_left(num_decodes=8, decode_keys=800) is None
    unfitted = Pacing(0.150, min_prefill_tokens=16)
    assert unfitted.time_left(num_decodes=8, decode_keys=800) is None
    assert _pacing().chunk(None, start=0, wanted=128, prefilled=0) == 128


def test_every_step_gets_at_least_the_floor_of_prompt_tokens() -> None:
    pacing = _pacing(max_itl=0.001)  # less than the decodes alone take
    time_left = pacing.time_left(num_decodes=32, decode_keys=32 * 1000)
    assert time_left is not None and time_left < 0
    assert pacing.chunk(time_left, start=0, wanted=100, prefilled=0) == 16
    assert pacing.chunk(time_left, start=0, wanted=100, prefilled=10) == 6
    assert pacing.chunk(time_left, start=0, wanted=100, prefilled=16) == 0
    assert pacing.chunk(time_left, start=0, wanted=5, prefilled=0) == 5


def test_the_histograms_count_cumulatively() -> None:
    histogram = Histogram((1.0, 10.0))
    for value in (0.5, 3.0, 30.0):
        histogram.observe(value)
    counts = histogram.frozen()
    assert (counts.counts, counts.num, counts.total) == ((1, 2), 3, 33.5)


# -- in the scheduler --------------------------------------------------------------------------
def _scheduler(max_itl: float | None, budget: int = 256) -> Scheduler:
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=16, dtype=torch.float32)
    sched = Scheduler(KVCacheManager(BlockPool(spec, 512), enable_auto_cache=False), 64, budget)
    sched.pacing = _pacing(max_itl)
    return sched


def _seq(index: int, num_prompt: int) -> Sequence:
    return Sequence(f"r{index}", list(range(num_prompt)), num_prompt, SamplingParams(), index)


def _step(sched: Scheduler) -> tuple[SchedulerOutput, int]:
    """One step as the engine runs it; the output and the keys its queries read."""
    out = sched.schedule()
    keys = out.num_attention_keys
    sampling = [s.seq for s in out.scheduled if s.is_sampling]
    sched.on_step_done(out)
    for seq in sampling:
        seq.token_ids.append(7)
    return out, keys


def _prompt_tokens(out: SchedulerOutput, request_id: str) -> int:
    return sum(s.num_new_tokens for s in out.scheduled if s.seq.request_id == request_id)


def test_prompt_chunks_beside_decodes_keep_the_step_within_the_target() -> None:
    sched = _scheduler(max_itl=0.150)
    for i in range(8):
        sched.add(_seq(i, 600))
    while any(s.num_uncomputed_tokens > 1 for s in sched.running) or sched.waiting:
        _step(sched)  # no decodes yet at first: whole budgets
    late = _seq(99, 1000)
    sched.add(late)
    chunks = []
    while late.num_computed_tokens < 1000:
        out, keys = _step(sched)
        chunks.append(_prompt_tokens(out, "r99"))
        assert _seconds(out.num_batched_tokens, keys) <= 0.150 * 1.001
    assert len(chunks) > 1000 // 256 + 1  # paced into more steps than the budget alone makes
    assert all(c >= 16 for c in chunks[:-1])


def test_without_decodes_a_prompt_gets_the_whole_budget() -> None:
    sched = _scheduler(max_itl=0.001, budget=256)
    sched.add(_seq(0, 600))
    assert _prompt_tokens(_step(sched)[0], "r0") == 256


def test_without_a_target_the_token_budget_alone_decides() -> None:
    sched = _scheduler(max_itl=None, budget=256)
    for i in range(4):
        sched.add(_seq(i, 20))
    _step(sched)
    sched.add(_seq(9, 600))
    assert _prompt_tokens(_step(sched)[0], "r9") == 256 - 4
