"""PrefixLoader: turns validated PrefixSpecs into pinned, registered prefixes.

Prefixes are filled as internal sequences that the engine queues ahead of every waiting
request (`start` returns them), so a (re)load is chunked like any prefill and never stalls
running decodes for longer than one chunk. A fill computes its prompt only: its last logits
come back through the sequence's `on_prefilled` hook, which pins its blocks. When the last
fill completes, the new set is swapped in at once; unchanged entries (same name, same token
ids) keep their blocks, and prefixes that left the set are released (requests still holding
their blocks keep them until they finish).

A `PrefixSnapshots` store (the engine's, over its KV tensors) may hold an entry's KV from an
earlier run: such an entry is restored into fresh blocks instead of filled, and a filled one is
handed to the store to be written. Both are exact: a snapshot is used only when it was made by
this very model, format, dtype and kernel build from the same token ids.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.core.errors import EngineError
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from engine.kvcache.block_pool import BlockPool, num_blocks_for
from engine.registry.index import PrefixIndex
from engine.registry.registry import PrefixRegistry, RegisteredPrefix, ReloadStatus, release
from engine.registry.spec import PrefixSpec

logger = logging.getLogger(__name__)

FILL_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


def _spec_ids(spec: PrefixSpec) -> tuple[int, ...]:
    return spec.token_ids


class PrefixSnapshots(Protocol):
    """KV of filled prefixes kept across restarts (engine/kv_snapshots.py)."""

    def restore(self, spec: PrefixSpec) -> tuple[list[int], torch.Tensor] | None:
        """`spec`'s KV read into freshly allocated blocks (one reference each) and its last
        logits, or None (no usable snapshot: the reason is logged)."""
        ...

    def save(self, spec: PrefixSpec, block_ids: list[int], logits: torch.Tensor) -> None:
        """Keep a freshly filled prefix's KV for the next start (written off this thread)."""
        ...

    def prune(self, names: Iterable[str]) -> None:
        """The entries `names` are the loaded set: stale snapshots of others may go."""
        ...


class PrefixBudgetError(EngineError):
    """The prefixes would pin so much of the KV pool that no full-length request fits."""


@dataclass(frozen=True, slots=True)
class FillChange:
    """What a (re)load asks of the scheduler: queue `new` ahead of every waiting sequence
    (in order), and finish `dropped` (the fills of a reload this one replaced)."""

    new: list[Sequence]
    dropped: list[Sequence]


@dataclass(slots=True)
class _Pending:
    specs: list[PrefixSpec]
    ready: dict[str, RegisteredPrefix]
    filling: dict[str, Sequence]
    callbacks: list[Callable[[ReloadStatus], None]] = field(default_factory=list)
    # A reload failed after this one began: that failure is the newer outcome, and stays what
    # the status says when this one finishes (the file on disk is still the bad one).
    overtaken: bool = False


class PrefixLoader:
    """Engine-thread only. One (re)load at a time; a newer one replaces the pending one.

    The one writer of `registry.last_reload`: a load that completes, or one that failed
    before it started (`fail`)."""

    def __init__(
        self,
        registry: PrefixRegistry,
        pool: BlockPool,
        max_model_len: int,
        next_arrival: Callable[[], int],
        enabled: bool,
        snapshots: PrefixSnapshots | None = None,
    ) -> None:
        self.registry = registry
        self.snapshots = snapshots
        self.pool = pool
        self.max_model_len = max_model_len
        self.next_arrival = next_arrival
        self.enabled = enabled
        self.specs: list[PrefixSpec] = []  # the last accepted set, even with caching off
        # The same set by content, for contract lookups (any thread: swapped, never mutated)
        self.spec_index: PrefixIndex[PrefixSpec] = PrefixIndex((), _spec_ids, self.pool.block_size)
        self._pending: _Pending | None = None

    @property
    def is_pending(self) -> bool:
        return self._pending is not None

    @property
    def num_pending_tokens(self) -> int:
        if self._pending is None:
            return 0
        return sum(s.num_uncomputed_tokens for s in self._pending.filling.values())

    def block_holders(self) -> list[list[int]]:
        """Block tables this loader owns right now (fills in flight, filled but not swapped)."""
        if self._pending is None:
            return []
        live = {id(p) for p in self.registry.prefixes.values()}
        filled = [p.block_ids for p in self._pending.ready.values() if id(p) not in live]
        return [s.block_table for s in self._pending.filling.values()] + filled

    def start(
        self, specs: list[PrefixSpec], on_done: Callable[[ReloadStatus], None] | None = None
    ) -> FillChange:
        """Begin loading `specs`; raises PrefixBudgetError (old set untouched) if too big.
        Returns the fills to queue and those to drop.

        Reloads coalesce: while one is pending, a reload of the same specs joins it, and a
        reload of other specs replaces it and answers its waiters too (the newest file is what
        every one of them asked for), so concurrent reloads all succeed.
        """
        callbacks = [on_done] if on_done else []
        pending = self._pending
        if pending is not None and pending.specs == list(specs):
            pending.callbacks += callbacks
            pending.overtaken = False  # this reload is the newest again
            return FillChange([], [])
        self._check_budget(specs)
        dropped, dropped_callbacks = self._drop_pending()
        callbacks = dropped_callbacks + callbacks
        self.specs = list(specs)
        self.spec_index = PrefixIndex(self.specs, _spec_ids, self.pool.block_size)
        pending = _Pending(list(specs), {}, {}, callbacks)
        self._pending = pending
        if self.enabled:
            for spec in specs:
                ready = self.registry.unchanged(spec) or self._restore(spec)
                if ready is not None:
                    pending.ready[spec.name] = ready
                else:
                    pending.filling[spec.name] = self._fill(spec)
        self._maybe_finish()
        return FillChange(list(pending.filling.values()), dropped)

    def fail(self, error: str, on_done: Callable[[ReloadStatus], None] | None = None) -> None:
        """A reload that could not start (unreadable or invalid file): the old registry
        stays, and the failure is what the status says."""
        status = ReloadStatus(time.time(), False, error, len(self.registry.prefixes))
        self.registry.last_reload = status
        if self._pending is not None:
            self._pending.overtaken = True
        logger.error("prefix reload failed, keeping the old registry: %s", error)
        if on_done is not None:
            on_done(status)

    def _on_filled(self, spec: PrefixSpec, seq: Sequence, logits: torch.Tensor) -> None:
        """A fill computed its last token (the scheduler has let go of it): its blocks
        become a pinned prefix."""
        assert self._pending is not None and self._pending.filling.get(spec.name) is seq
        self.pool.pin(seq.block_table)
        if self.snapshots is not None:
            self.snapshots.save(spec, seq.block_table, logits)
        del self._pending.filling[spec.name]
        self._pending.ready[spec.name] = RegisteredPrefix(
            spec, seq.block_table, logits, self.pool.block_size
        )
        self._maybe_finish()

    def _drop_pending(self) -> tuple[list[Sequence], list[Callable[[ReloadStatus], None]]]:
        """Drop a pending reload (release what it filled): its fills, to be finished by the
        caller, and its waiters."""
        pending, self._pending = self._pending, None
        if pending is None:
            return [], []
        live = {id(p) for p in self.registry.prefixes.values()}
        for prefix in pending.ready.values():
            if id(prefix) not in live:
                release(self.pool, prefix)
        return list(pending.filling.values()), pending.callbacks

    def _restore(self, spec: PrefixSpec) -> RegisteredPrefix | None:
        """`spec` from its snapshot, pinned like a filled prefix, or None (fill it)."""
        restored = self.snapshots.restore(spec) if self.snapshots is not None else None
        if restored is None:
            return None
        block_ids, logits = restored
        self.pool.pin(block_ids)
        return RegisteredPrefix(spec, block_ids, logits, self.pool.block_size)

    def _fill(self, spec: PrefixSpec) -> Sequence:
        seq = Sequence(
            request_id=f"prefix-fill:{spec.name}:{time.monotonic_ns()}",
            token_ids=list(spec.token_ids),
            num_prompt_tokens=len(spec.token_ids),
            params=FILL_PARAMS,
            arrival_index=self.next_arrival(),
            on_prefilled=lambda seq, logits: self._on_filled(spec, seq, logits),
        )
        return seq

    def _maybe_finish(self) -> None:
        pending = self._pending
        if pending is None or pending.filling:
            return
        self._pending = None
        self.registry.install(pending.specs, pending.ready)
        if self.snapshots is not None:
            self.snapshots.prune(spec.name for spec in pending.specs)
        status = ReloadStatus(time.time(), True, None, len(pending.specs))
        if not pending.overtaken:
            self.registry.last_reload = status
        for prefix in self.registry.prefixes.values():
            logger.info(
                "prefix %r: %d tokens in %d blocks%s",
                prefix.name,
                prefix.num_tokens,
                len(prefix.block_ids),
                " (partial tail block)" if prefix.is_tail_partial else "",
            )
        for callback in pending.callbacks:
            callback(status)

    def _check_budget(self, specs: list[PrefixSpec]) -> None:
        """New + still-pinned blocks must leave room for one full-length request."""
        if not self.enabled:
            return
        block_size = self.pool.block_size
        kept = {id(p) for s in specs if (p := self.registry.unchanged(s)) is not None}
        new_blocks = sum(
            num_blocks_for(len(s.token_ids), block_size)
            for s in specs
            if self.registry.unchanged(s) is None
        )
        pinned = self.registry.num_pinned_blocks
        leaving = sum(
            len(p.block_ids) for p in self.registry.prefixes.values() if id(p) not in kept
        )
        limit = self.pool.num_blocks - num_blocks_for(self.max_model_len, block_size)
        peak = pinned + new_blocks  # old and new are both pinned until the swap
        if peak > limit:
            raise PrefixBudgetError(
                f"the prefixes need {peak * block_size} tokens of pinned KV cache during the "
                f"reload ({new_blocks} new blocks, {pinned} pinned, {leaving} to be released); "
                f"at most {limit * block_size} may be pinned so that a request of "
                f"max_model_len={self.max_model_len} still fits. Raise --kv-cache-memory."
            )
