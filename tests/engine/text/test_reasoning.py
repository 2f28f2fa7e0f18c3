"""engine.text.reasoning: which models think, and a thinking answer split into its reasoning
and its content, the same whether it comes whole or in pieces."""

from __future__ import annotations

import random

import pytest
from transformers import PreTrainedTokenizerFast

from engine.core.sampling_params import ThinkFirst
from engine.text.reasoning import ReasoningFormat, reasoning_format_of, split_reasoning
from engine.text.tokenizer import Tokenizer

THINK = ReasoningFormat("<think>", "</think>", 7, 8)
QWEN3_LIKE = (
    "{{ '<|im_start|>assistant\\n' }}{% if not enable_thinking %}<think>\n\n</think>{% endif %}"
)


def test_a_model_thinks_where_its_template_writes_the_tags_and_they_are_tokens() -> None:
    vocab = {"<think>": 7, "</think>": 8}
    assert reasoning_format_of(QWEN3_LIKE, vocab) == THINK
    assert reasoning_format_of(QWEN3_LIKE, {"<think>": 7}) is None  # not both tokens
    assert reasoning_format_of("{{ messages }}", vocab) is None  # the template never thinks
    assert reasoning_format_of(None, vocab) is None


@pytest.mark.parametrize(
    ("text", "opens_in_prompt", "expected"),
    [
        ("<think>\nOkay, let me see.\n</think>\n\nParis.", False, ("Okay, let me see.", "Paris.")),
        ("Paris.", False, (None, "Paris.")),  # thinking off: no block in the answer
        ("  <think>a</think>b", False, ("a", "b")),
        ("<think>\n\n</think>\n\nYes", False, ("", "Yes")),  # an empty block
        ("Let me think.\n</think>\n\nYes", True, ("Let me think.", "Yes")),  # opened by the prompt
        ("<think>cut in the middle", False, ("cut in the middle", "")),  # the length limit
        ("<thi", False, (None, "<thi")),  # a tag's start that never became one is text
        ("<tool_call>{}</tool_call>", False, (None, "<tool_call>{}</tool_call>")),
        ("<think>x</thin", False, ("x</thin", "")),
        ("<think>x < y </think> done", False, ("x < y", "done")),
        ("<think>a</think>b</think>c", False, ("a", "b</think>c")),  # one block only
        ("Sure <think>no</think>", False, (None, "Sure <think>no</think>")),  # not at the start
    ],
)
def test_an_answer_splits_the_same_whole_and_in_any_pieces(
    text: str, opens_in_prompt: bool, expected: tuple[str | None, str]
) -> None:
    assert split_reasoning(THINK, text, opens_in_prompt) == expected
    # where the block ends: after its first closing tag, or at the end of a cut answer
    block_end = None
    if expected[0] is not None:
        close = text.find("</think>", 0 if opens_in_prompt else text.index("<think>") + 1)
        block_end = len(text) if close < 0 else close + len("</think>")
    for seed in range(40):
        rng = random.Random(seed)
        splitter = THINK.splitter(opens_in_prompt)
        reasoning = content = ""
        start = 0
        while start < len(text):
            end = start + rng.randint(1, 5)
            part_reasoning, part_content = splitter.feed(text[start:end])
            reasoning, content, start = reasoning + part_reasoning, content + part_content, end
        last_reasoning, last_content = splitter.finish()
        pieces = (reasoning + last_reasoning if splitter.thought else None, content + last_content)
        assert pieces == expected, f"seed {seed}"
        assert splitter.block_end == block_end, f"seed {seed}"


def test_a_stream_holds_back_only_what_may_be_a_tag() -> None:
    """Reasoning and content stream as they come; only a tag's possible start waits."""
    splitter = THINK.splitter()
    assert splitter.feed("<thi") == ("", "")
    assert splitter.feed("nk>\n") == ("", "")  # spaces after the tag are dropped
    assert splitter.feed("Let") == ("Let", "")
    assert splitter.feed(" me see") == (" me see", "")
    assert splitter.feed(" </th") == ("", "")  # the spaces wait with the tag's start
    assert splitter.feed("ink>\n\nPar") == ("", "Par")
    assert splitter.feed("is.") == ("", "is.")
    assert splitter.finish() == ("", "")
    plain = THINK.splitter()
    assert plain.feed("Paris") == ("", "Paris")
    assert not plain.thought


def test_where_the_prompt_leaves_the_answer_is_read_from_its_last_tag_but_spaces(
    tiny_tokenizer: PreTrainedTokenizerFast,
) -> None:
    """Inside a block the prompt opened, after one it closed (thinking turned off), or free;
    a constrained answer thinks first unless the block is closed."""
    tokenizer = Tokenizer.from_transformers(tiny_tokenizer)
    space = tokenizer.encode("\n", add_special_tokens=False)
    word = tokenizer.encode("hello", add_special_tokens=False)
    cases = {
        (*word, 7, *space, *space): "opened",
        (7,): "opened",
        (7, *word): "free",
        (7, 8, *space): "closed",
        (8, *space, *space): "closed",
        (8, *word): "free",
        (*word,): "free",
        (): "free",
    }
    assert {ids: THINK.prompt_end(tokenizer, ids) for ids in cases} == cases
    assert THINK.think_first("opened") == ThinkFirst(7, 8, "</think>", opened=True)
    assert THINK.think_first("free") == ThinkFirst(7, 8, "</think>", opened=False)
    assert THINK.think_first("closed") is None
