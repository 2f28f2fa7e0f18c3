"""Continuous batching: which sequences run this step, with how many new tokens each.

Every step has a token budget (`max_num_batched_tokens`). Decoding sequences (one new token
each) are served first, oldest first; prefills then fill what is left of the budget in chunks,
so a long prompt is spread over several steps instead of stalling every running decode for a
whole prefill. New requests are admitted at every step while there is budget, a free slot
(`max_num_seqs`) and KV blocks for their first chunk.

Prefix reuse happens at admission, on token ids only, and is the KVCacheManager's policy
(`match` then `attach`; it owns every block): a sequence starts from the longer of its
registry match (a registered prefix its ids start with: full blocks shared, a partial last
block copied; ids equal to the prefix need no forward at all, the prefix's stored logits are
sampled) and its automatic cache hit (the longest run of cached full blocks in its own cache
scope: earlier turns of a chat, repeated requests, any prompt sharing a start with one
computed before, its own blocks after a preemption). Identical fresh prompts admitted in the
same step are prefilled once: the first is the leader, the others share its blocks and its
logits row. Deduplication stays inside one cache scope (the request's `cache_salt`) and is
invisible to clients: a duplicate reports the cached tokens its leader got from the caches,
never the leader's own work, so `cached_tokens` cannot confirm a guess of another client's
prompt. This module keeps the queues, the token budget and preemption.

When a sequence needs a block and none is free, the newest running sequence is preempted:
its blocks are released and it goes back to the front of the waiting queue to be recomputed
later (prompt + the tokens it already produced), instead of the engine failing. It is
admitted again only when its whole recompute fits, so it cannot be preempted again before
it has caught up.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from engine.core.sequence import Sequence, SequenceStatus
from engine.kvcache.block_pool import num_blocks_for
from engine.kvcache.manager import BlockCopy, KVCacheManager
from engine.scheduler.pacing import Pacing, StepCostModel, attention_keys


@dataclass(slots=True)
class ScheduledSequence:
    """A sequence and how many new tokens it feeds this step.

    `num_new_tokens == 0` happens for exact registry hits (`cached_logits` holds the row to
    sample) and in-batch duplicates (`leader` is the sequence whose logits row they share).
    A decode's last `num_draft_tokens` new tokens are the first of `seq.draft_token_ids`,
    fed after its own tokens to be verified (speculative decoding).
    """

    seq: Sequence
    num_new_tokens: int
    cached_logits: torch.Tensor | None = None
    leader: Sequence | None = None
    num_draft_tokens: int = 0

    @property
    def is_sampling(self) -> bool:
        """True when this chunk reaches the last known token, so a new token gets sampled."""
        num_own = self.num_new_tokens - self.num_draft_tokens
        return self.seq.num_computed_tokens + num_own == self.seq.num_tokens

    @property
    def is_prefill(self) -> bool:
        """A chunk of a prompt (or of a recompute): more than one token, not a decode's
        (whose tokens past the sampled one its grammar forced). Read before `on_step_done`."""
        return _is_prompt_chunk(self.seq, self.num_new_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Copies of partially shared tail blocks, before or after this step's forward (the
    # executor owns the K/V data and runs them)
    copies: list[BlockCopy] = field(default_factory=list)
    # Sequences that left the running set since the last step (finished, aborted, handed
    # over, preempted): the executor forgets their rows
    released_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of prompt chunks (prompts, recomputes; not a decode's forced tokens)."""
        return sum(s.num_new_tokens for s in self.scheduled if s.is_prefill)

    @property
    def num_logits_rows(self) -> int:
        """Positions whose logits the forward computes: a sampling row per computed sequence
        that samples, and one per draft token."""
        return sum(
            1 + s.num_draft_tokens for s in self.scheduled if s.num_new_tokens and s.is_sampling
        )

    @property
    def num_attention_keys(self) -> int:
        """Keys the step's queries read (valid until `on_step_done` advances the counts)."""
        return sum(
            attention_keys(s.seq.num_computed_tokens, s.num_new_tokens) for s in self.scheduled
        )

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting and running queues and every sequence's KV blocks."""

    def __init__(
        self,
        cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_itl: float | None = None,
        speculative: bool = False,
    ) -> None:
        self.cache = cache
        self.block_size = cache.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Prompt chunks beside running decodes are sized to keep them within `max_itl`
        # seconds a step, at least a block of prompt per step (pacing.py)
        self.pacing = Pacing(max_itl, min_prefill_tokens=self.block_size)
        # Draft tokens (seq.draft_token_ids) join decodes when the cost model says they pay
        self.speculative = speculative
        self.num_draft_tokens = 0  # scheduled for verification, in total
        # The acceptance a decode's first draft token needed in the last step with decodes
        # (`_add_drafts`): the drafter does not search for requests below it. 0.0 until the
        # step cost model is fitted (every draft is taken then)
        self.draft_bar = 0.0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._released_ids: list[str] = []  # for the next SchedulerOutput

    # -- queue management -----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_first(self, seq: Sequence) -> None:
        """Queue `seq` ahead of every waiting sequence (registry fills)."""
        self.waiting.appendleft(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    def finish(self, seq: Sequence, finish_reason: str) -> None:
        """Remove a sequence from whichever queue holds it and release its blocks."""
        self.detach(seq)
        self.cache.free(seq)
        seq.finish_reason = finish_reason

    def detach(self, seq: Sequence) -> None:
        """Remove a sequence from the queues; its blocks stay with the caller (a new owner)."""
        self._released_ids.append(seq.request_id)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    # -- the step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        step = _StepRoom(self.max_num_batched_tokens, self._pacing_time())
        # Decodes first (oldest first), then unfinished prefills: see the module docstring.
        for seq in sorted(self.running, key=lambda s: (not _is_decode(s), s.arrival_index)):
            if step.tokens == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._chunk(seq, step)
            if num_new == 0 or not self._reserve_or_preempt(seq, num_new, out):
                continue
            out.scheduled.append(ScheduledSequence(seq, num_new))
            self._take(seq, num_new, step)
        if not out.preempted:
            self._admit_waiting(out, step)
        if self.speculative:
            self._add_drafts(out, step)
        if not out.is_empty:  # an empty output runs nothing: the ids wait for the next one
            out.released_ids, self._released_ids = self._released_ids, []
        return out

    def record_step(self, out: SchedulerOutput, seconds: float) -> None:
        """A forward's wall time, before `on_step_done`: counted for /metrics, and what
        pacing's cost model learns from when pacing is on."""
        num_prefill = out.num_prefill_tokens
        self.pacing.count(num_prefill, num_prefill < out.num_batched_tokens, seconds)
        if self.pacing.is_on or self.speculative:
            self.pacing.cost.observe(
                out.num_batched_tokens, out.num_attention_keys, seconds, out.num_logits_rows
            )

    def on_step_done(self, out: SchedulerOutput) -> None:
        """After the forward: advance computed-token counts and index the blocks that are
        now full and computed. Draft tokens count once accepted (`LLMEngine._append`): the
        K/V of rejected ones sit past `num_computed_tokens`, overwritten before anything
        reads them."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens - item.num_draft_tokens
            item.seq.draft_token_ids = []
        for item in out.scheduled:
            self.cache.index_computed(item.seq)

    # -- internals ------------------------------------------------------------------------------
    def _pacing_time(self) -> float | None:
        """Seconds this step's prompt chunks may take (None: no limit, and nothing counted)."""
        if not self.pacing.is_on:
            return None
        decodes = [s for s in self.running if _is_decode(s)]
        return self.pacing.time_left(len(decodes), sum(s.num_tokens for s in decodes))

    def _chunk(self, seq: Sequence, step: _StepRoom) -> int:
        """New tokens `seq` may feed this step: a decode's token(s), or a prompt chunk within
        the step's token budget and pacing's time."""
        num_new = min(seq.num_uncomputed_tokens, step.tokens)
        if not _is_prompt_chunk(seq, num_new):
            return num_new
        return self.pacing.chunk(step.seconds, seq.num_computed_tokens, num_new, step.prefilled)

    def _take(self, seq: Sequence, num_new: int, step: _StepRoom) -> None:
        """Count a scheduled chunk (before `seq.num_computed_tokens` advances)."""
        step.tokens -= num_new
        if _is_prompt_chunk(seq, num_new):
            step.seconds = self.pacing.spent(step.seconds, seq.num_computed_tokens, num_new)
            step.prefilled += num_new

    def _add_drafts(self, out: SchedulerOutput, step: _StepRoom) -> None:
        """Give decodes the draft tokens that raise their expected tokens per second.

        The step's decodes alone would cost S seconds (the cost model's estimate) for D
        tokens, one per decode: what a token costs without drafts. A sequence's i-th draft
        token adds Δ seconds (a position and its logits row) and yields a token with the
        chance that it and every draft before it are accepted, p^i (p:
        `seq.draft_acceptance`). Drafts are taken best yield per second first while that
        beats the decodes' running yield per second: beside one decode a row is cheap next
        to the step's weight reads and a draft pays even at modest odds; beside many decodes
        a row costs nearly a token and only sure drafts pay. Prompt chunks in the step do not
        lower the bar (they are other work, not these tokens). Until the model has seen
        enough steps every draft is taken (that is how it learns what rows cost). Drafts use
        only what is left of the token budget and blocks that are free: they never preempt."""
        decodes = [item for item in out.scheduled if item.is_sampling and item.seq.is_decoding]
        if not decodes:
            return
        cost = self.pacing.cost
        gained = float(len(decodes))
        spent = cost.seconds(
            sum(item.num_new_tokens for item in decodes),
            sum(attention_keys(i.seq.num_computed_tokens, i.num_new_tokens) for i in decodes),
            len(decodes),
        )
        self.draft_bar = _first_draft_bar(cost, decodes, gained, spent)
        items = [item for item in decodes if item.seq.draft_token_ids]
        if not items:
            return
        candidates: list[tuple[float, float, int, int]] = []  # (yield, seconds, item, i)
        for index, item in enumerate(items):
            seq, p = item.seq, item.seq.draft_acceptance
            position = seq.num_computed_tokens + item.num_new_tokens  # of its first draft
            for i in range(1, len(seq.draft_token_ids) + 1):
                seconds = cost.marginal(1, position + i, 1) if cost.is_ready else 0.0
                candidates.append((p**i, max(seconds, 1e-9), index, i))
        candidates.sort(key=lambda c: (-c[0] / c[1], c[3]))
        taken = [0] * len(items)
        for expected, seconds, index, i in candidates:
            if step.tokens == 0:
                break
            if cost.is_ready and expected * spent <= gained * seconds:
                break  # no better than the decodes' own tokens per second
            if i != taken[index] + 1:
                continue  # its earlier draft token was not taken
            taken[index] = i
            step.tokens -= 1
            gained += expected
            spent += seconds
        for item, num_drafts in zip(items, taken, strict=True):
            seq = item.seq
            if (
                num_drafts
                and self.cache.allocate_slots(seq, item.num_new_tokens + num_drafts) is None
            ):
                # no free block for them all: those that fit in the blocks it holds
                room = len(seq.block_table) * self.block_size - seq.num_computed_tokens
                num_drafts = max(0, min(num_drafts, room - item.num_new_tokens))
            if num_drafts == 0:
                seq.draft_token_ids = []
                continue
            num_new = item.num_new_tokens + num_drafts
            seq.draft_token_ids = seq.draft_token_ids[:num_drafts]
            item.num_new_tokens = num_new
            item.num_draft_tokens = num_drafts
            self.num_draft_tokens += num_drafts

    def _admit_waiting(self, out: SchedulerOutput, step: _StepRoom) -> None:
        if not self.waiting:
            return
        self.cache.begin_step()
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            item = self._admit_one(seq, step, out)
            if item is None:
                break  # head of line waits for budget or blocks: no overtaking, no starvation
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(item)
            self._take(seq, item.num_new_tokens, step)

    def _admit_one(
        self, seq: Sequence, step: _StepRoom, out: SchedulerOutput
    ) -> ScheduledSequence | None:
        match = self.cache.match(seq)
        copies: list[BlockCopy] = []
        if match is not None and match.leader is not None:  # prefilled once, in this step
            if not self.cache.attach(seq, match, copies):
                return None
            out.copies += copies
            return ScheduledSequence(seq, 0, leader=match.leader)
        is_fresh_request = (
            seq.num_prompt_tokens == seq.num_tokens
            and not seq.is_prompt_only
            and seq.num_preemptions == 0
        )
        attached = match is not None and self.cache.attach(seq, match, copies)
        num_new = self._chunk(seq, step)
        if (
            (num_new == 0 and seq.num_uncomputed_tokens > 0)
            or not self._has_room_to_recompute(seq)
            or self.cache.allocate_slots(seq, num_new) is None
        ):
            self.cache.free(seq)  # gives back what attach shared; its copies never run
            seq.num_computed_tokens = 0
            return None
        out.copies += copies
        if is_fresh_request:
            # What the client sees as cached: its prompt's reuse at first admission (a
            # preempted sequence's recompute from its own blocks is not the client's gain).
            seq.num_cached_tokens = seq.num_computed_tokens
            self.cache.record_lookup(match if attached else None)
        self.cache.note_admitted(seq, num_new)
        exact_logits = match.exact_logits(seq) if match is not None and attached else None
        return ScheduledSequence(seq, num_new, exact_logits)

    def _has_room_to_recompute(self, seq: Sequence) -> bool:
        """A preempted sequence comes back only when all it must recompute, and its next
        token, fit in free blocks. Admitted on its first chunk alone, it was preempted again
        before it caught up, its recompute thrown away (six 256-token requests in 48 blocks:
        30 preemptions, 5,490 tokens computed for 1,596 needed)."""
        if seq.num_preemptions == 0:
            return True
        needed = num_blocks_for(seq.num_tokens + 1, self.block_size) - len(seq.block_table)
        return self.cache.can_allocate(max(needed, 0))

    def _reserve_or_preempt(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Reserve blocks for `num_new` more tokens, preempting newer sequences if needed.

        Returns False when `seq` itself had to be preempted.
        """
        scheduled = {id(item.seq) for item in out.scheduled}
        while self.cache.allocate_slots(seq, num_new) is None:
            victims = [s for s in self.running if id(s) not in scheduled and s is not seq]
            victim = max(victims, key=lambda s: s.arrival_index) if victims else seq
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._released_ids.append(seq.request_id)
        self.running.remove(seq)
        self.cache.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1


@dataclass(slots=True)
class _StepRoom:
    """What is left of one step as the scheduler fills it."""

    tokens: int  # of the token budget
    seconds: float | None  # of pacing's time for prompt chunks (None: no limit)
    prefilled: int = 0  # prompt tokens scheduled so far


def _is_prompt_chunk(seq: Sequence, num_new: int) -> bool:
    """`num_new` tokens of `seq` are prompt (or recompute) tokens that pacing may cut and
    counts: more than one, and not a decode's forced tokens. Read before `on_step_done`."""
    return num_new > 1 and not seq.is_decoding


def _is_decode(seq: Sequence) -> bool:
    """Scheduled first and never cut by pacing: a decode (with any tokens its grammar forced),
    or whatever has a single token left to feed."""
    return seq.num_uncomputed_tokens == 1 or seq.is_decoding


def _first_draft_bar(
    cost: StepCostModel, decodes: list[ScheduledSequence], gained: float, spent: float
) -> float:
    """The acceptance below which no first draft token pays beside these decodes: a draft
    token is taken while its yield per second beats theirs (`_add_drafts`), so the first of
    a request's drafts needs p * spent > gained * (its row's cost); taken at their mean
    context. 0.0 before the cost model is fitted (every draft is taken then)."""
    if not cost.is_ready or spent <= 0.0:
        return 0.0
    position = sum(item.seq.num_computed_tokens + item.num_new_tokens for item in decodes)
    row = cost.marginal(1, position // len(decodes) + 1, 1)
    return min(1.0, gained * max(row, 0.0) / spent)
