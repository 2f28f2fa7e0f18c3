"""Earlier answers as a draft source: requests that hit the same registry entry tend to give
the same answers (the same labels, the same boilerplate), and no one but the server sees them.

Each scope keeps the most recent answers of its requests, bounded in tokens, each stored with
the last few prompt tokens before it, so that an answer's very first tokens are proposed too
(the prompt of every request ends with the same generation prompt). A scope is (tenant, cache
salt, registry entry): the same walls as the prefix cache's, so one tenant's answers are never
proposed to another (engine/kvcache/block_hash.py keys cached blocks the same way).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from engine.speculative.ngram import SEPARATOR, Match, TokenBuffer, find_continuation

AnswerScope = tuple[str | None, str | None, str | None]  # tenant, cache salt, registry entry


@dataclass(frozen=True, slots=True)
class AnswerIndexLimits:
    max_scopes: int = 256  # least recently used scopes are dropped past this
    max_tokens_per_scope: int = 8192
    context_tokens: int = 4  # prompt tokens stored before each answer


class AnswerIndex:
    """Engine-thread only. Per scope, a buffer of [SEPARATOR, context..., answer...] runs."""

    def __init__(self, limits: AnswerIndexLimits | None = None) -> None:
        self.limits = limits or AnswerIndexLimits()
        self._scopes: OrderedDict[AnswerScope, TokenBuffer] = OrderedDict()

    def add(self, scope: AnswerScope, prompt_ids: list[int], answer_ids: list[int]) -> None:
        """Remember an answer (and the tail of its prompt) in `scope`."""
        if not answer_ids:
            return
        limits = self.limits
        run = [SEPARATOR, *prompt_ids[-limits.context_tokens :], *answer_ids]
        run = run[: limits.max_tokens_per_scope]
        buffer = self._scopes.pop(scope, None) or TokenBuffer()
        self._scopes[scope] = buffer  # most recently used last
        overflow = buffer.size + len(run) - limits.max_tokens_per_scope
        if overflow > 0:
            buffer.drop_front(overflow)  # the oldest runs (a cut one cannot match across)
        buffer.extend(run)
        while len(self._scopes) > limits.max_scopes:
            self._scopes.popitem(last=False)

    def find(
        self, scope: AnswerScope, suffix: np.ndarray, min_n: int, max_n: int, k: int
    ) -> Match | None:
        buffer = self._scopes.get(scope)
        if buffer is None:
            return None
        return find_continuation(buffer.view, suffix, min_n, max_n, k)

    @property
    def num_scopes(self) -> int:
        return len(self._scopes)
