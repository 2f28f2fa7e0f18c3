"""PrefixIndex: the longest registered entry a prompt starts with, in time that grows with the
prompt, not with the number of entries.

Each entry is filed under the content hash of its last full block (engine/block_hash.py,
registry scope; the scope's seed for an entry shorter than one block). A prompt's chain of
block hashes names every block boundary it has; at each one, only the entries that end
there (with their few tail tokens) are compared. 10,000 entries cost what one does: a dict
probe per block of the prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

from engine.kvcache.block_hash import REGISTRY_SEED, BlockHash, registry_hashes

E = TypeVar("E")


class PrefixIndex(Generic[E]):
    """Immutable: a reload builds a new one and swaps it in (readers on other threads see the
    old or the new, never a mix)."""

    def __init__(
        self, entries: Iterable[E], token_ids_of: Callable[[E], Sequence[int]], block_size: int
    ) -> None:
        self.block_size = block_size
        self._token_ids_of = token_ids_of
        self._ending_at: dict[BlockHash, list[E]] = {}
        for entry in entries:
            ids = token_ids_of(entry)
            hashes = registry_hashes(ids, block_size)
            boundary = hashes[-1] if hashes else REGISTRY_SEED
            self._ending_at.setdefault(boundary, []).append(entry)

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._ending_at.values())

    def longest(
        self,
        token_ids: Sequence[int],
        hashes: Sequence[BlockHash] | None = None,
        visible: Callable[[E], bool] | None = None,
    ) -> E | None:
        """The longest entry whose token ids start `token_ids` (equal ids included), among
        those `visible` accepts. `hashes`: the prompt's registry_hashes, if already made."""
        if not self._ending_at:
            return None
        if hashes is None:
            hashes = registry_hashes(token_ids, self.block_size)
        best: E | None = None
        best_length = -1
        for num_blocks, boundary in enumerate((REGISTRY_SEED, *hashes)):
            for entry in self._ending_at.get(boundary, ()):
                ids = self._token_ids_of(entry)
                start = num_blocks * self.block_size
                if (
                    (visible is None or visible(entry))
                    and len(ids) > best_length
                    and len(ids) <= len(token_ids)
                    and tuple(token_ids[start : len(ids)]) == tuple(ids[start:])
                ):
                    best, best_length = entry, len(ids)
        return best
