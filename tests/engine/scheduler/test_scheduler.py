"""Scheduler: token budget, decode-first ordering, chunked prefill, admission, preemption."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence, SequenceStatus
from engine.kvcache.block_pool import BlockPool, KVCacheSpec
from engine.kvcache.manager import KVCacheManager
from engine.scheduler.scheduler import Scheduler, SchedulerOutput


def _scheduler(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 32) -> Scheduler:
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4, dtype=torch.float32)
    pool = BlockPool(spec, num_blocks)
    return Scheduler(KVCacheManager(pool, enable_auto_cache=False), max_num_seqs, budget)


def _seq(index: int, num_prompt: int) -> Sequence:
    return Sequence(f"r{index}", list(range(num_prompt)), num_prompt, SamplingParams(), index)


def _plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]


def _finish_step(sched: Scheduler, out: SchedulerOutput, next_token: int = 7) -> None:
    """What the engine does after a forward: advance, append a token where one was sampled."""
    sampling = [s.seq for s in out.scheduled if s.is_sampling]
    sched.on_step_done(out)
    for seq in sampling:
        seq.token_ids.append(next_token)


def test_long_prompt_is_chunked_by_the_token_budget() -> None:
    sched = _scheduler(budget=32)
    sched.add(_seq(0, 70))
    plans = []
    for _ in range(3):
        out = sched.schedule()
        plans.append(_plan(out))
        assert [s.is_sampling for s in out.scheduled] == [len(plans) == 3]
        _finish_step(sched, out)
    assert plans == [[("r0", 32)], [("r0", 32)], [("r0", 6)]]
    assert sched.running[0].block_table == list(range(18))  # ceil(70 / 4) blocks, in order


def test_decodes_go_first_and_prefill_gets_the_rest_of_the_budget() -> None:
    sched = _scheduler(budget=16)
    for i in range(3):
        sched.add(_seq(i, 4))
    _finish_step(sched, sched.schedule())  # all three prefilled in one step (12 tokens)
    sched.add(_seq(3, 40))  # a long prompt arrives while three sequences decode
    out = sched.schedule()
    assert _plan(out) == [("r0", 1), ("r1", 1), ("r2", 1), ("r3", 13)]
    _finish_step(sched, out)
    # Next step: the partial prefill must not push the decodes out.
    assert _plan(sched.schedule()) == [("r0", 1), ("r1", 1), ("r2", 1), ("r3", 13)]


def test_admission_respects_max_num_seqs_and_fifo() -> None:
    sched = _scheduler(max_num_seqs=2, budget=100)
    for i in range(3):
        sched.add(_seq(i, 5))
    out = sched.schedule()
    assert _plan(out) == [("r0", 5), ("r1", 5)]
    assert [s.request_id for s in sched.waiting] == ["r2"]
    _finish_step(sched, out)
    sched.finish(sched.running[0], "stop")
    assert _plan(sched.schedule()) == [("r1", 1), ("r2", 5)]


def test_head_of_line_waits_for_blocks_instead_of_being_skipped() -> None:
    sched = _scheduler(num_blocks=4, budget=100)
    sched.add(_seq(0, 12))  # 3 blocks
    sched.add(_seq(1, 8))  # 2 blocks: does not fit beside r0
    sched.add(_seq(2, 2))  # 1 block: would fit, but must not overtake r1
    out = sched.schedule()
    assert _plan(out) == [("r0", 12)]
    assert [s.request_id for s in sched.waiting] == ["r1", "r2"]


def test_newest_sequence_is_preempted_when_blocks_run_out() -> None:
    sched = _scheduler(num_blocks=4, budget=100)
    sched.add(_seq(0, 8))  # 2 blocks, full
    sched.add(_seq(1, 8))  # 2 blocks, full
    _finish_step(sched, sched.schedule())
    out = sched.schedule()  # both need a third block for their next token: only r0 can have it
    assert _plan(out) == [("r0", 1)]
    assert [s.request_id for s in out.preempted] == ["r1"]
    victim = sched.waiting[0]
    assert (victim.request_id, victim.num_computed_tokens, victim.block_table) == ("r1", 0, [])
    assert victim.status is SequenceStatus.WAITING and victim.num_preemptions == 1
    assert victim.token_ids == [*range(8), 7]  # recomputed later with the token it produced
    sched.cache.pool.check_integrity()
    assert sched.cache.pool.num_free_blocks == 1


def test_preempted_sequence_is_recomputed_once_blocks_come_back() -> None:
    sched = _scheduler(num_blocks=4, budget=100)
    sched.add(_seq(0, 8))
    sched.add(_seq(1, 8))
    _finish_step(sched, sched.schedule())
    _finish_step(sched, sched.schedule())  # r1 preempted here
    sched.finish(sched.running[0], "stop")
    out = sched.schedule()
    assert _plan(out) == [("r1", 9)]  # prompt + the token it had produced
    assert out.scheduled[0].is_sampling


def test_finish_releases_blocks_of_waiting_and_running_sequences() -> None:
    sched = _scheduler(budget=8)
    sched.add(_seq(0, 20))
    sched.add(_seq(1, 4))
    _finish_step(sched, sched.schedule())  # r0 partially prefilled, r1 still waiting
    for seq in [*sched.running, *sched.waiting]:
        sched.finish(seq, "abort")
    assert not sched.has_unfinished()
    assert sched.cache.pool.num_free_blocks == sched.cache.pool.num_blocks
    sched.cache.pool.check_integrity()


def test_a_preempted_sequence_waits_until_its_whole_recompute_fits() -> None:
    """r1 was preempted holding 10 tokens: its next chunk (3 tokens, 1 block) fits in the 2
    free blocks, but its whole recompute plus its next token (3 blocks) does not, and coming
    back on a chunk alone it would be preempted again before catching up."""
    sched = _scheduler(num_blocks=5, budget=4)
    sched.add(_seq(0, 8))
    for _ in range(2):  # r0's prompt in two chunks of 4; it samples a token
        _finish_step(sched, sched.schedule())
    r1 = Sequence("r1", [*range(8), 7, 7], 8, SamplingParams(), 1, num_preemptions=1)
    sched.add(r1)
    assert _plan(sched.schedule()) == [("r0", 1)]  # r0 takes its 3rd block; 2 stay free
    assert sched.cache.pool.num_free_blocks == 2 and r1 in sched.waiting
    sched.finish(sched.running[0], "stop")
    assert _plan(sched.schedule()) == [("r1", 4)]  # now all of it fits: it catches up
    sched.cache.pool.check_integrity()


def test_no_sequence_is_preempted_again_before_it_catches_up(tiny_llama_path: Path) -> None:
    """Six 256-token requests in a 48-block pool: every sequence preempted twice had computed
    more tokens by its second preemption than it held at its first (no thrashing)."""
    engine = LLMEngine(
        EngineConfig(model=str(tiny_llama_path), block_size=16, num_kv_blocks=48, max_model_len=512)
    )
    history: dict[str, list[tuple[int, int]]] = {}  # request id -> (computed, held) per preemption
    preempt = engine.scheduler._preempt

    def recording(seq: Sequence) -> None:
        history.setdefault(seq.request_id, []).append((seq.num_computed_tokens, seq.num_tokens))
        preempt(seq)

    engine.scheduler._preempt = recording  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    engine.generate([engine.tokenizer.encode(f"prompt {i} says hi") for i in range(6)], params)
    assert engine.scheduler.num_preemptions > 0
    for events in history.values():
        for (_, held_before), (computed, _) in itertools.pairwise(events):
            assert computed > held_before
    engine.check_integrity()
