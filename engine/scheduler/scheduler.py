"""Continuous batching: which sequences run this step, with how many new tokens each.

Every step has a token budget (`max_num_batched_tokens`). Decoding sequences (one new token
each) are served first, oldest first; prefills then fill what is left of the budget in chunks,
so a long prompt is spread over several steps instead of stalling every running decode for a
whole prefill. New requests are admitted at every step while there is budget, a free slot
(`max_num_seqs`) and KV blocks for their first chunk.

Prefix reuse happens at admission, on token ids only, through the KVCacheManager (which owns
every block): a sequence starts from the longer of its registry match (a registered prefix its
ids start with: full blocks shared, a partial last block copied; ids equal to the prefix need
no forward at all, the prefix's stored logits are sampled) and its automatic cache hit (the
longest run of cached full blocks in its own cache scope: earlier turns of a chat, repeated
requests, any prompt sharing a start with one computed before, its own blocks after a
preemption). Identical fresh prompts admitted in the same step are prefilled once: the first
is the leader, the others share its blocks and its logits row. Deduplication stays inside one
cache scope (the request's `cache_salt`) and is invisible to clients: a duplicate reports the
cached tokens its leader got from the caches, never the leader's own work, so
`cached_tokens` cannot confirm a guess of another client's prompt.

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
from engine.kvcache.block_hash import registry_seed
from engine.kvcache.block_pool import num_blocks_for
from engine.kvcache.manager import CacheHit, KVCacheManager
from engine.registry.index import registry_hashes
from engine.registry.registry import PrefixMatch, PrefixRegistry

# In-step deduplication key: (cache scope, prompt token ids); None: not deduplicated.
_DedupKey = tuple[str | None, tuple[int, ...]] | None


@dataclass(slots=True)
class ScheduledSequence:
    """A sequence and how many new tokens it feeds this step.

    `num_new_tokens == 0` happens for exact registry hits (`cached_logits` holds the row to
    sample) and in-batch duplicates (`leader` is the sequence whose logits row they share).
    """

    seq: Sequence
    num_new_tokens: int
    cached_logits: torch.Tensor | None = None
    leader: Sequence | None = None

    @property
    def is_sampling(self) -> bool:
        """True when this chunk reaches the last known token, so a new token gets sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # (src, dst) block copies to run once this step's forward has filled `src`
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

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
        registry: PrefixRegistry | None = None,
    ) -> None:
        self.cache = cache
        self.block_size = cache.block_size
        self.registry = registry  # None: every form of reuse is off
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

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
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

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
        """After the forward: advance computed-token counts, copy duplicates' tail blocks,
        and index the blocks that are now full and computed."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        for src, dst in out.block_copies:
            self.cache.copy_block(src, dst)
        for item in out.scheduled:
            self.cache.index_computed(item.seq)

    # -- internals ------------------------------------------------------------------------------
    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        leaders: dict[_DedupKey, Sequence] = {}
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            item = self._admit_one(seq, budget, leaders, out)
            if item is None:
                break  # head of line waits for budget or blocks: no overtaking, no starvation
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(item)
            budget -= item.num_new_tokens

    def _admit_one(
        self,
        seq: Sequence,
        budget: int,
        leaders: dict[_DedupKey, Sequence],
        out: SchedulerOutput,
    ) -> ScheduledSequence | None:
        # A request that scores its prompt needs every position computed: no shared work.
        can_share = self.registry is not None and seq.params.prompt_logprobs is None
        can_dedup = (
            can_share
            and seq.num_computed_tokens == 0
            and (seq.num_output_tokens == 0 and not seq.is_prompt_only)
        )
        key: _DedupKey = (seq.cache_salt, tuple(seq.token_ids)) if can_dedup else None
        if key is not None and key in leaders:
            return self._admit_duplicate(seq, leaders[key], out)
        is_fresh_request = (
            seq.num_prompt_tokens == seq.num_tokens
            and not seq.is_prompt_only
            and seq.num_preemptions == 0
        )
        match = self._attach_cached(seq) if can_share and seq.num_computed_tokens == 0 else None
        num_new = min(seq.num_uncomputed_tokens, budget)
        if (
            (num_new == 0 and seq.num_uncomputed_tokens > 0)
            or not self._has_room_to_recompute(seq)
            or not self.cache.reserve(seq, num_new)
        ):
            self.cache.free(seq)
            seq.num_computed_tokens = 0
            return None
        if is_fresh_request:
            # What the client sees as cached: its prompt's reuse at first admission (a
            # preempted sequence's recompute from its own blocks is not the client's gain).
            seq.num_cached_tokens = seq.num_computed_tokens
            if self.registry is not None:
                self.registry.record_lookup(match)
        if key is not None and num_new == seq.num_uncomputed_tokens and num_new > 0:
            leaders[key] = seq
        exact_logits = match.prefix.last_logits if match is not None and num_new == 0 else None
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

    def _attach_cached(self, seq: Sequence) -> PrefixMatch | None:
        """Start `seq` from the longer of its registry match and its automatic cache hit
        (the registry wins a tie: its exact hits need no forward). Returns the registry
        match when that is what was used."""
        match, hit = self.best_cached(seq)
        if hit is None or not self.cache.can_share(hit):
            return None
        tail_copy = self.cache.share(seq, hit)
        if tail_copy is not None:
            self.cache.copy_block(*tail_copy)
        seq.num_shared_blocks = self._num_pinned_leading(seq.block_table)
        return match if hit.source == "registry" else None

    def best_cached(self, seq: Sequence) -> tuple[PrefixMatch | None, CacheHit | None]:
        """The registry match of `seq`, and the longest cached start it can share. Preferred
        on equal length: a whole registered prefix (an exact one needs no forward), its
        blocks up to a divergence, then the prompt's own scope. Takes nothing."""
        assert self.registry is not None
        if seq.registry_chains is None:
            seeds = [registry_seed()] + ([registry_seed(seq.tenant)] if seq.tenant else [])
            seq.registry_chains = [
                registry_hashes(seq.token_ids, self.block_size, seed) for seed in seeds
            ]
        match = self.registry.match(seq.token_ids, seq.registry_chains[0], seq.tenant)
        candidates = [
            CacheHit(match.prefix.block_ids, match.num_tokens, "registry") if match else None,
            *(
                self.cache.find_run(chain, seq.num_tokens, "registry-partial")
                for chain in seq.registry_chains
            ),
            self.cache.find_cached(seq),
        ]
        hit = max(
            (c for c in candidates if c is not None), key=lambda c: c.num_tokens, default=None
        )
        return match, hit

    def _num_pinned_leading(self, block_ids: list[int]) -> int:
        """Leading blocks that belong to a registry prefix: decodes sharing them are attended
        as a cascade group (engine/attention.py)."""
        pool = self.cache.pool
        count = 0
        for block_id in block_ids:
            if not pool.is_pinned(block_id):
                break
            count += 1
        return count

    def _admit_duplicate(
        self, seq: Sequence, leader: Sequence, out: SchedulerOutput
    ) -> ScheduledSequence | None:
        """Same prompt as a sequence prefilled in this very step: share its work. Its tail
        block is copied after the forward that fills it."""
        hit = CacheHit(leader.block_table, leader.num_tokens, "batch")
        if not self.cache.can_share(hit):
            return None
        tail_copy = self.cache.share(seq, hit)
        if tail_copy is not None:
            out.block_copies.append(tail_copy)
        seq.num_shared_blocks = leader.num_shared_blocks  # the registry part, as the leader's
        # Report what the leader got from the registry, not the leader's own prefill: the
        # duplicate's usage must read as if it had been admitted alone (no side channel).
        seq.num_cached_tokens = leader.num_cached_tokens
        return ScheduledSequence(seq, 0, leader=leader)

    def _reserve_or_preempt(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Reserve blocks for `num_new` more tokens, preempting newer sequences if needed.

        Returns False when `seq` itself had to be preempted.
        """
        scheduled = {id(item.seq) for item in out.scheduled}
        while not self.cache.reserve(seq, num_new):
            victims = [s for s in self.running if id(s) not in scheduled and s is not seq]
            victim = max(victims, key=lambda s: s.arrival_index) if victims else seq
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
