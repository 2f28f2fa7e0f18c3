"""Continuous batching: which sequences run this step, with how many new tokens each.

Every step has a token budget (`max_num_batched_tokens`). Decoding sequences (one new token
each) are served first, oldest first; prefills then fill what is left of the budget in chunks,
so a long prompt is spread over several steps instead of stalling every running decode for a
whole prefill. New requests are admitted at every step while there is budget, a free slot
(`max_num_seqs`) and KV blocks for their first chunk.

When a sequence needs a block and none is free, the newest running sequence is preempted:
its blocks are released and it goes back to the front of the waiting queue to be recomputed
later (prompt + the tokens it already produced), instead of the engine failing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache import BlockPool, num_blocks_for
from engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def is_sampling(self) -> bool:
        """True when this chunk reaches the last known token, so a new token gets sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting and running queues and every sequence's KV blocks."""

    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- queue management -----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    def finish(self, seq: Sequence, finish_reason: str) -> None:
        """Remove a sequence from whichever queue holds it and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release_blocks(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = finish_reason

    # -- the step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # Decodes first (oldest first), then unfinished prefills: see the module docstring.
        for seq in sorted(
            self.running, key=lambda s: (s.num_uncomputed_tokens > 1, s.arrival_index)
        ):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self._reserve_or_preempt(seq, num_new, out):
                continue
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def on_step_done(self, out: SchedulerOutput) -> None:
        """Advance each scheduled sequence's computed-token count after its forward ran."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens

    # -- internals ------------------------------------------------------------------------------
    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self._reserve(seq, num_new):
                break  # head of line waits for blocks: no overtaking, no starvation
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new

    def _reserve_or_preempt(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Reserve blocks for `num_new` more tokens, preempting newer sequences if needed.

        Returns False when `seq` itself had to be preempted.
        """
        scheduled = {id(item.seq) for item in out.scheduled}
        while not self._reserve(seq, num_new):
            victims = [s for s in self.running if id(s) not in scheduled and s is not seq]
            victim = max(victims, key=lambda s: s.arrival_index) if victims else seq
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _reserve(self, seq: Sequence, num_new: int) -> bool:
        needed = num_blocks_for(seq.num_computed_tokens + num_new, self.pool.block_size)
        missing = needed - len(seq.block_table)
        if missing <= 0:
            return True
        if not self.pool.can_allocate(missing):
            return False
        seq.block_table.extend(self.pool.allocate(missing))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release_blocks(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release_blocks(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)
        seq.block_table = []
