"""RequestText: the engine's token-level deltas in, the text clients read out (stop strings,
EOS and stop tokens shown as nothing, held-back text flushed at the end)."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from engine import RequestOutput, SamplingParams
from engine.text.detokenizer import RequestText

PROMPT = "Tell me about the fox."


def _delta(token_id: int, num_done: int, finish: str | None = None, stop: int | None = None):  # type: ignore[no-untyped-def]
    return RequestOutput("r-0", "", [token_id], 5, num_done, 0, finish, stop)


def _run(
    tok: PreTrainedTokenizerFast, ids: list[int], params: SamplingParams, last_finish: str | None
) -> tuple[RequestText, list[RequestOutput]]:
    """Feed `ids` one delta each, the last one finished by the engine with `last_finish`."""
    text = RequestText(tok, tok.encode(PROMPT), params, {tok.eos_token_id})
    outputs = []
    for i, token_id in enumerate(ids):
        finish = last_finish if i == len(ids) - 1 else None
        outputs.append(text.process(_delta(token_id, i + 1, finish)))
        if outputs[-1].finished:
            break
    return text, outputs


def test_the_deltas_add_up_to_the_decoded_output(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tiny_tokenizer.encode(" the quick brown fox jumps over the lazy dog")
    text, outputs = _run(tiny_tokenizer, ids, SamplingParams(), "length")
    assert "".join(o.text for o in outputs) == tiny_tokenizer.decode(ids)
    assert [o.token_ids for o in outputs] == [[t] for t in ids]
    assert (outputs[-1].finish_reason, text.is_finished) == ("length", True)
    assert all(not o.finished for o in outputs[:-1])


def test_a_stop_string_finishes_the_request_before_the_engine_does(
    tiny_tokenizer: PreTrainedTokenizerFast,
) -> None:
    ids = tiny_tokenizer.encode(" the quick brown fox jumps over the lazy dog")
    text, outputs = _run(tiny_tokenizer, ids, SamplingParams(stop=["fox"]), None)
    assert "".join(o.text for o in outputs) == " the quick brown "
    last = outputs[-1]
    assert (last.finish_reason, last.stop_reason, text.is_finished) == ("stop", "fox", True)
    assert len(outputs) < len(ids)  # the engine's later deltas are not asked for
    with pytest.raises(AssertionError, match="after the request finished"):
        text.process(_delta(ids[-1], len(ids)))


def test_an_eos_token_shows_no_text_and_flushes_what_was_held_back(
    tiny_tokenizer: PreTrainedTokenizerFast,
) -> None:
    """ " the fo" may be the start of the stop string " the fox": held back until the end."""
    ids = [*tiny_tokenizer.encode(" the quick the fo"), tiny_tokenizer.eos_token_id]
    params = SamplingParams(stop=[" the fox"])
    _, outputs = _run(tiny_tokenizer, ids, params, "stop")
    assert outputs[-1].token_ids == [tiny_tokenizer.eos_token_id]
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", None)
    assert "".join(o.text for o in outputs[:-1]) == " the quick"
    assert outputs[-1].text == " the fo"  # the flush; nothing of the EOS token itself


def test_a_stop_token_id_shows_no_text(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tiny_tokenizer.encode(" the quick brown")
    stop_id = ids[-1]
    text = RequestText(tiny_tokenizer, [1, 2], SamplingParams(stop_token_ids=[stop_id]), set())
    outputs = [text.process(_delta(t, i + 1)) for i, t in enumerate(ids[:-1])]
    outputs.append(text.process(_delta(stop_id, len(ids), "stop", stop_id)))
    assert "".join(o.text for o in outputs) == tiny_tokenizer.decode(ids[:-1])
    assert (outputs[-1].text, outputs[-1].stop_reason) == ("", stop_id)


def test_an_ignored_eos_is_text_like_any_token(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    eos = tiny_tokenizer.eos_token_id
    text = RequestText(tiny_tokenizer, [1, 2], SamplingParams(ignore_eos=True), {eos})
    out = text.process(_delta(eos, 1, "length"))
    params = SamplingParams(ignore_eos=True, skip_special_tokens=False)
    shown = RequestText(tiny_tokenizer, [1, 2], params, {eos}).process(_delta(eos, 1, "length"))
    assert (out.text, shown.text) == ("", tiny_tokenizer.eos_token)  # skipped as a special only


@pytest.mark.parametrize("finish", ["abort", None])
def test_aborts_and_errors_pass_through(
    tiny_tokenizer: PreTrainedTokenizerFast, finish: str | None
) -> None:
    text = RequestText(tiny_tokenizer, [1, 2], SamplingParams(), set())
    out = RequestOutput("r-0", "", [], 5, 0, 0, finish, error=None if finish else "boom")
    assert text.process(out) is out
    assert text.is_finished == (finish is not None)


@pytest.mark.parametrize("group", [2, 3, 5])
def test_a_delta_of_several_tokens_offsets_each_where_one_step_each_would(
    tiny_tokenizer: PreTrainedTokenizerFast, group: int
) -> None:
    """Several tokens in one delta (drafts kept, forced tokens, merged steps): the same text,
    and each token's text offset where one delta a token puts it."""
    ids = tiny_tokenizer.encode(" the quick brown fox jumps over the lazy dog")
    _, single = _run(tiny_tokenizer, ids, SamplingParams(), "length")
    want: list[int] = []
    for out in single:
        want += [sum(len(o.text) for o in single[: len(want)]) + o for o in out.offsets()]
    text = RequestText(tiny_tokenizer, tiny_tokenizer.encode(PROMPT), SamplingParams(), set())
    grouped = []
    for start in range(0, len(ids), group):
        chunk = ids[start : start + group]
        finish = "length" if start + group >= len(ids) else None
        out = RequestOutput("r-0", "", chunk, 5, start + len(chunk), 0, finish)
        grouped.append(text.process(out))
    merged = grouped[0]
    for out in grouped[1:]:
        merged = merged.followed_by(out)
    assert merged.text == "".join(o.text for o in single)
    assert merged.offsets() == want
    assert want == sorted(want) and want[0] == 0 and len(set(want)) > 1
