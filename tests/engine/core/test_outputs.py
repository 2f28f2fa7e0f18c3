"""RequestOutput.followed_by: two consecutive deltas as one."""

from __future__ import annotations

from engine import RequestOutput, SampleLogprobs, TokenLogprob


def delta(text: str, ids: list[int], total: int, **more: object) -> RequestOutput:
    return RequestOutput("r", text, ids, 7, total, 3, **more)  # type: ignore[arg-type]


def logprob(token_id: int) -> SampleLogprobs:
    return SampleLogprobs(token_id, -0.5, (TokenLogprob(token_id, -0.5),))


def test_text_tokens_and_logprobs_concatenate_counts_come_from_the_later() -> None:
    first = delta("Hel", [1], 1, logprobs=[logprob(1)], prompt_logprobs=[None])
    second = delta("lo", [2, 3], 3, logprobs=[logprob(2), logprob(3)])
    merged = first.followed_by(second)
    assert (merged.text, merged.token_ids) == ("Hello", [1, 2, 3])
    assert merged.num_completion_tokens == 3
    assert [s.token_id for s in merged.logprobs or []] == [1, 2, 3]
    assert merged.prompt_logprobs == [None]
    assert not merged.finished


def test_the_last_delta_finishes_the_merge() -> None:
    merged = delta("a", [1], 1).followed_by(delta("b", [2], 2, finish_reason="stop"))
    assert merged.finished and merged.finish_reason == "stop"
    assert merged.logprobs is None


def test_the_parts_are_not_changed() -> None:
    first, second = delta("a", [1], 1), delta("b", [2], 2)
    first.followed_by(second)
    assert (first.text, first.token_ids, second.text, second.token_ids) == ("a", [1], "b", [2])
