"""The drafter: drafts from the request's own tokens and its scope's earlier answers, within
its length limits, and an acceptance estimate that follows how its drafts fared."""

from __future__ import annotations

from engine import SamplingParams
from engine.core.sequence import Sequence
from engine.speculative.drafter import Drafter


def _seq(
    request_id: str, token_ids: list[int], max_tokens: int | None = 32, tenant: str | None = None
) -> Sequence:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return Sequence(request_id, list(token_ids), len(token_ids), params, 0, tenant=tenant)


def test_a_run_copied_from_the_prompt_is_drafted() -> None:
    drafter = Drafter(max_draft_tokens=4, max_model_len=100)
    seq = _seq("a", [7, 1, 2, 3, 4, 5, 6, 9, 8, 1, 2])
    drafter.start(seq, None)
    drafter.propose(seq)
    assert seq.draft_token_ids == [3, 4, 5, 6]


def test_no_search_below_the_bar_a_busy_step_sets() -> None:
    """A new request's acceptance is 1/2: a bar above it (many decodes, rows that cost
    nearly a token) leaves it without drafts; at or under it, the run is drafted."""
    drafter = Drafter(max_draft_tokens=4, max_model_len=100)
    seq = _seq("a", [7, 1, 2, 3, 4, 5, 6, 9, 8, 1, 2])
    drafter.start(seq, None)
    drafter.propose(seq, bar=0.6)
    assert seq.draft_token_ids == []
    drafter.propose(seq, bar=0.5)
    assert seq.draft_token_ids == [3, 4, 5, 6]


def test_drafts_stop_where_max_tokens_or_the_context_ends() -> None:
    prompt = [7, 1, 2, 3, 4, 5, 6, 9, 8, 1, 2]
    for max_tokens, max_model_len, room in ((3, 100, 2), (32, 14, 2), (1, 100, 0)):
        drafter = Drafter(max_draft_tokens=4, max_model_len=max_model_len)
        seq = _seq("a", prompt, max_tokens=max_tokens)
        drafter.start(seq, None)
        drafter.propose(seq)
        assert seq.draft_token_ids == [3, 4, 5, 6][:room], (max_tokens, max_model_len)


def test_an_earlier_answer_in_the_scope_drafts_the_next_answer_from_its_start() -> None:
    drafter = Drafter(max_draft_tokens=8, max_model_len=100)
    first = _seq("a", [40, 41, 42, 43, 44], tenant="acme")
    drafter.start(first, "intent")
    first.token_ids += [90, 91, 92, 2]
    drafter.finish(first, remember=True)

    same = _seq("b", [50, 41, 42, 43, 44], tenant="acme")
    drafter.start(same, "intent")
    drafter.propose(same)
    assert same.draft_token_ids == [90, 91, 92, 2]

    for request_id, tenant, entry in (("c", "globex", "intent"), ("d", "acme", "support")):
        other = _seq(request_id, [50, 41, 42, 43, 44], tenant=tenant)
        drafter.start(other, entry)
        drafter.propose(other)
        assert other.draft_token_ids == [], (tenant, entry)


def test_an_aborted_answer_is_not_remembered() -> None:
    drafter = Drafter(max_draft_tokens=8, max_model_len=100)
    first = _seq("a", [40, 41, 42, 43, 44])
    drafter.start(first, "intent")
    first.token_ids += [90, 91]
    drafter.finish(first, remember=False)
    again = _seq("b", [40, 41, 42, 43, 44])
    drafter.start(again, "intent")
    drafter.propose(again)
    assert again.draft_token_ids == []


def test_acceptance_falls_with_rejections_and_rises_with_kept_runs() -> None:
    drafter = Drafter(max_draft_tokens=4, max_model_len=100)
    seq = _seq("a", [1, 2, 3])
    drafter.start(seq, None)
    assert seq.draft_acceptance == 0.5
    for _ in range(4):
        drafter.record(seq, 4, 0)
    assert seq.draft_acceptance < 0.25
    for _ in range(8):
        drafter.record(seq, 4, 4)
    assert seq.draft_acceptance > 0.9
    assert drafter.counts()[""].drafted == 48
    assert drafter.counts()[""].accepted == 32


def test_a_new_request_starts_from_its_scopes_record() -> None:
    drafter = Drafter(max_draft_tokens=4, max_model_len=100)
    copier = _seq("a", [1, 2, 3], tenant="acme")
    drafter.start(copier, "doc")
    for _ in range(10):
        drafter.record(copier, 4, 4)
    drafter.finish(copier, remember=True)
    same_scope = _seq("b", [1, 2, 3], tenant="acme")
    drafter.start(same_scope, "doc")
    assert same_scope.draft_acceptance > 0.8
    other_scope = _seq("c", [1, 2, 3], tenant="globex")
    drafter.start(other_scope, "doc")
    assert other_scope.draft_acceptance == 0.5
