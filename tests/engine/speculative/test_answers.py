"""Earlier answers as drafts, per scope (tenant, cache salt, registry entry), bounded."""

from __future__ import annotations

import numpy as np

from engine.speculative.answers import AnswerIndex, AnswerIndexLimits

PROMPT = [11, 12, 13, 14, 15]
ANSWER = [60, 61, 62, 2]


def _first_draft(index: AnswerIndex, scope, k: int = 8) -> list[int] | None:
    match = index.find(scope, np.array(PROMPT[-4:]), 2, 4, k)
    return match.continuation if match is not None else None


def test_an_answer_is_proposed_from_its_start_in_its_own_scope() -> None:
    index = AnswerIndex()
    index.add(("acme", "salt", "intent"), PROMPT, ANSWER)
    assert _first_draft(index, ("acme", "salt", "intent")) == ANSWER


def test_no_answer_crosses_a_tenant_a_salt_or_an_entry() -> None:
    index = AnswerIndex()
    index.add(("acme", "salt", "intent"), PROMPT, ANSWER)
    for other in (
        ("globex", "salt", "intent"),
        (None, "salt", "intent"),
        ("acme", "other", "intent"),
        ("acme", None, "intent"),
        ("acme", "salt", "support"),
        ("acme", "salt", None),
    ):
        assert _first_draft(index, other) is None, other


def test_the_newest_answer_wins_and_old_ones_are_dropped_past_the_bound() -> None:
    limits = AnswerIndexLimits(max_scopes=2, max_tokens_per_scope=24, context_tokens=4)
    index = AnswerIndex(limits)
    scope = ("t", None, "e")
    for i in range(10):
        index.add(scope, PROMPT, [100 + i, 101 + i, 2])
    assert _first_draft(index, scope) == [109, 110, 2]
    index.add(("u", None, "e"), PROMPT, ANSWER)
    index.add(("v", None, "e"), PROMPT, ANSWER)
    assert index.num_scopes == 2
    assert _first_draft(index, scope) is None  # the least recently used scope went first
