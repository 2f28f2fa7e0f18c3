"""Find where the last few tokens occurred before, and what followed them there.

Prompt lookup decoding (transformers' `prompt_lookup_num_tokens`, vLLM's `ngram` proposer,
llama.cpp's lookup decoding): the model's next tokens are often a copy of a run it has
already seen (a quote, a field copied into JSON, a line it repeats). The draft is what
followed the most recent earlier occurrence of the longest suffix of `n` tokens that recurs.
Searched with numpy over a buffer of token ids: a few microseconds for a few thousand tokens,
so no index has to be kept up to date as tokens arrive.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Separates stored runs in a buffer (no token id is negative): a match never spans two runs
# and a continuation stops at the end of its run.
SEPARATOR = -1


@dataclass(frozen=True, slots=True)
class Match:
    """A suffix of `n` tokens found earlier, and the tokens that followed it there."""

    n: int
    continuation: list[int]


class TokenBuffer:
    """A growing int32 array of token ids (amortised appends, numpy views for the search)."""

    def __init__(self, capacity: int = 256) -> None:
        self._data = np.empty(capacity, dtype=np.int32)
        self.size = 0

    def extend(self, token_ids: list[int]) -> None:
        end = self.size + len(token_ids)
        if end > len(self._data):
            grown = np.empty(max(end, 2 * len(self._data)), dtype=np.int32)
            grown[: self.size] = self._data[: self.size]
            self._data = grown
        self._data[self.size : end] = token_ids
        self.size = end

    def drop_front(self, count: int) -> None:
        """Forget the first `count` ids (a bounded buffer keeps the newest)."""
        count = min(count, self.size)
        self._data[: self.size - count] = self._data[count : self.size]
        self.size -= count

    @property
    def view(self) -> np.ndarray:
        return self._data[: self.size]


def find_continuation(
    history: np.ndarray, suffix: np.ndarray, min_n: int, max_n: int, k: int
) -> Match | None:
    """The longest `n` in [min_n, max_n] whose last `n` tokens of `suffix` occur in `history`
    with at least one token after them; the up to `k` tokens after the most recent such
    occurrence (stopping at a SEPARATOR). `history` may end with `suffix` itself (a request's
    own tokens): that occurrence has nothing after it, so it is never the match.

    One pass over `history` (where the suffix's last token occurs), then each longer `n`
    filters those places by the token before: every decoding request searches after every
    step, and a scope's answers hold thousands of tokens."""
    max_n = min(max_n, len(suffix))
    if max_n < min_n:
        return None
    ends = np.flatnonzero(history[: len(history) - 1] == suffix[-1])  # a token must follow
    found: list[np.ndarray] = []  # found[n - min_n]: the ends of the n-token matches
    for n in range(1, max_n + 1):
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[history[ends - (n - 1)] == suffix[-n]]
        if ends.size == 0:
            break
        if n >= min_n:
            found.append(ends)
    for index in range(len(found) - 1, -1, -1):
        end = int(found[index][-1])
        after = history[end + 1 : end + 1 + k]
        stops = np.flatnonzero(after == SEPARATOR)
        continuation = after[: stops[0]] if stops.size else after
        if continuation.size:
            return Match(min_n + index, continuation.tolist())
    return None
