"""Which draft tokens join a step (Scheduler._add_drafts): those whose expected tokens per
second beat the step's own, from the cost model; never past the budget or free blocks."""

from __future__ import annotations

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from engine.kvcache.block_pool import BlockPool, KVCacheSpec
from engine.kvcache.manager import KVCacheManager
from engine.scheduler.scheduler import Scheduler, SchedulerOutput

DRAFTS = [50, 51, 52, 53]


def _scheduler(num_blocks: int = 256, budget: int = 256) -> Scheduler:
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4, dtype=torch.float32)
    pool = BlockPool(spec, num_blocks)
    cache = KVCacheManager(pool, enable_auto_cache=False)
    return Scheduler(cache, 64, budget, speculative=True)


def _teach(sched: Scheduler, fixed: float, per_token: float) -> None:
    """Decode steps of a machine whose step costs `fixed` + `per_token` x tokens seconds."""
    for tokens in (1, 2, 4, 8, 16, 3, 5, 12, 1, 6, 9, 2):
        sched.pacing.cost.observe(tokens, 0, fixed + per_token * tokens, tokens)


def _decoding(sched: Scheduler, num: int, acceptance: float) -> list[Sequence]:
    """`num` sequences past their prefill, each with DRAFTS proposed."""
    seqs = []
    for i in range(num):
        seq = Sequence(f"r{i}", list(range(8)), 8, SamplingParams(temperature=0), i)
        sched.add(seq)
        seqs.append(seq)
    out = sched.schedule()
    sched.on_step_done(out)
    for seq in seqs:
        seq.token_ids.append(7)
        seq.draft_token_ids = list(DRAFTS)
        seq.draft_acceptance = acceptance
    return seqs


def _drafts(out: SchedulerOutput) -> list[int]:
    return [item.num_draft_tokens for item in out.scheduled]


def test_one_decode_takes_drafts_at_even_odds_many_decodes_only_sure_ones() -> None:
    # A step's fixed cost is 3 rows' worth: one decode's draft row is cheap, a 16-decode
    # step's rows cost nearly a token each.
    for num, acceptance, expected in (
        (1, 0.5, [1]),  # 0.5 / 1 row beats 1 token / 4 rows; 0.25 does not
        (1, 0.9, [4]),
        (16, 0.5, [0] * 16),
        (16, 0.9, [1] * 16),  # 0.9 beats 16 / 19 (0.84), 0.81 does not
        (16, 0.99, [4] * 16),
    ):
        sched = _scheduler()
        _teach(sched, fixed=3e-3, per_token=1e-3)
        _decoding(sched, num, acceptance)
        out = sched.schedule()
        assert _drafts(out) == expected, (num, acceptance)
        assert [item.num_new_tokens for item in out.scheduled] == [1 + d for d in expected]
        assert all(item.is_sampling for item in out.scheduled)


def test_the_bar_a_first_draft_must_clear_is_published_for_the_drafter() -> None:
    """`draft_bar` is the acceptance above which a first draft token is taken beside the
    step's decodes (what the drafter skips its search below): 1 token / 4 rows for one
    decode, 16 / 19 for sixteen (the steps above); 0.0 before the model is fitted."""
    for num, bar in ((1, 0.25), (16, 16 / 19)):
        sched = _scheduler()
        _decoding(sched, num, 0.5)
        assert sched.draft_bar == 0.0
        _teach(sched, fixed=3e-3, per_token=1e-3)
        for acceptance in (bar - 0.02, bar + 0.02):
            for seq in sched.running:
                seq.draft_token_ids, seq.draft_acceptance = list(DRAFTS), acceptance
            out = sched.schedule()
            assert sched.draft_bar == pytest.approx(bar, abs=0.01)
            assert all(d == (acceptance > bar) for d in _drafts(out)), (num, acceptance)
            sched.on_step_done(out)
            for seq in sched.running:
                seq.token_ids.append(7)
                seq.num_computed_tokens = len(seq.token_ids) - 1


def test_until_the_cost_model_has_seen_steps_every_draft_is_taken() -> None:
    sched = _scheduler()
    _decoding(sched, 2, 0.1)
    assert _drafts(sched.schedule()) == [4, 4]


def test_drafts_stay_within_the_token_budget_and_the_free_blocks() -> None:
    sched = _scheduler()
    _decoding(sched, 2, 0.9)
    sched.max_num_batched_tokens = 5
    assert _drafts(sched.schedule()) == [2, 1]  # 2 decodes + 3 drafts, the likeliest first
    # A pool that has a third block for each 9-token sequence and nothing more: the drafts
    # that fit in it (a draft never takes a block away, never preempts)
    sched = _scheduler(num_blocks=6)
    seqs = _decoding(sched, 2, 0.9)
    assert sched.cache.pool.num_free_blocks == 2
    out = sched.schedule()
    assert _drafts(out) == [3, 3]  # 9 + 3 tokens fill each one's third block exactly
    assert out.preempted == []
    assert sum(len(s.block_table) for s in seqs) == 6
    sched.on_step_done(out)
    assert [s.num_computed_tokens for s in seqs] == [9, 9]  # drafts count once accepted
    assert [s.draft_token_ids for s in seqs] == [[], []]
