"""A thinking model's answer split into its reasoning and its content.

Qwen3, SmolLM3 and the DeepSeek-R1 distills write their reasoning first, inside `<think>` ...
`</think>`, then the answer. OpenAI-compatible servers hand the two apart: the reasoning as
the message's `reasoning_content`, the answer as its `content` (vLLM's reasoning parsers,
llama.cpp server's `--reasoning-format`), so a client that shows or parses the answer never
sees the thinking. A model is read this way when its chat template writes both tags and its
tokenizer holds each as one token: the tags are then the model's markup, not text it
happened to write.

Where the answer starts: in reasoning when the output opens with `<think>` (after
whitespace) or when the prompt itself ends inside an open think block (templates that open it
for the model); otherwise the whole output is content, as when the client turned thinking
off (`chat_template_kwargs: {"enable_thinking": false}` makes Qwen3's and SmolLM3's templates
write an empty block into the prompt). An answer cut by the length limit before `</think>` is
all reasoning. Whitespace between `</think>` and the answer is dropped.

A constrained answer (a response format, a tool grammar) may think first: its grammar holds
from the end of the block (`think_first`), as vLLM's structured outputs do with a reasoning
parser, so a model trained to think before it calls a tool or writes JSON still does.

One splitter serves streams and whole answers alike (a whole answer is one delta), so both
give the same split; it holds back only text that may still be the start of a tag.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from engine.core.sampling_params import ThinkFirst

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"


PromptEnd = Literal["opened", "closed", "free"]


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """The served model's thinking markup, and the tags' token ids (a prompt that opens the
    block ends with the first; a grammar reads both as tokens)."""

    open_tag: str
    close_tag: str
    open_id: int
    close_id: int

    def prompt_end(self, tokenizer: Any, prompt_ids: Sequence[int]) -> PromptEnd:
        """Where the prompt leaves the answer: inside a think block ("opened": its last token
        other than whitespace is the opening tag), after one ("closed": the closing tag, as
        when the client turned thinking off), or free to open one; read from the end, a few
        tokens."""
        for token_id in reversed(prompt_ids):
            if token_id == self.open_id:
                return "opened"
            if token_id == self.close_id:
                return "closed"
            if tokenizer.decode([token_id]).strip():
                return "free"
        return "free"

    def splitter(self, opens_in_prompt: bool = False) -> ReasoningSplitter:
        return ReasoningSplitter(self, "opened" if opens_in_prompt else "start")

    def think_first(self, prompt_end: PromptEnd) -> ThinkFirst | None:
        """How a constrained answer may think first after a prompt ending so; None after a
        closed block (the constraint holds from the first token)."""
        if prompt_end == "closed":
            return None
        return ThinkFirst(
            self.open_id, self.close_id, self.close_tag, opened=prompt_end == "opened"
        )


def reasoning_format_of(
    chat_template: str | None, added_vocab: dict[str, int]
) -> ReasoningFormat | None:
    """The thinking markup of a model whose chat template writes `<think>` and `</think>` and
    whose tokenizer holds both as added tokens; None for any other model."""
    if not chat_template or OPEN_TAG not in chat_template or CLOSE_TAG not in chat_template:
        return None
    open_id, close_id = added_vocab.get(OPEN_TAG), added_vocab.get(CLOSE_TAG)
    if open_id is None or close_id is None:
        return None
    return ReasoningFormat(OPEN_TAG, CLOSE_TAG, open_id, close_id)


@dataclass(slots=True)
class ReasoningSplitter:
    """Feed an answer's text as it comes; get back the (reasoning, content) parts to send.
    Whitespace around the reasoning and before the content is dropped."""

    reasoning_format: ReasoningFormat
    # "start": not yet known whether the output opens with the tag; "opened": inside the
    # block, before its first non-space; "reasoning"; "gap": after the closing tag, before
    # the content's first non-space; "content"
    state: str
    held: str = ""
    thought: bool = False  # the answer has a reasoning part (possibly empty)
    fed: int = 0  # characters fed so far
    # where the block ends in the text fed (after its closing tag; the end of the text where
    # the answer stopped inside it): its reasoning tokens are those that start before
    block_end: int | None = None

    def __post_init__(self) -> None:
        if self.state == "opened":
            self.thought = True

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far ends inside the think block."""
        return self.state in ("opened", "reasoning")

    def feed(self, text: str) -> tuple[str, str]:
        # `pending` is always the undecided end of the text fed: it starts at fed - len(pending)
        self.fed += len(text)
        pending, self.held = self.held + text, ""
        reasoning = content = ""
        while pending:
            if self.state == "start":
                stripped = pending.lstrip()
                tag = self.reasoning_format.open_tag
                if stripped.startswith(tag):
                    self.state, self.thought = "opened", True
                    pending = stripped[len(tag) :]
                elif tag.startswith(stripped):  # whitespace, or a part of the tag: wait
                    self.held, pending = pending, ""
                else:
                    self.state = "content"
            elif self.state in ("opened", "gap"):
                pending = pending.lstrip()
                if pending:
                    self.state = "reasoning" if self.state == "opened" else "content"
            elif self.state == "reasoning":
                tag = self.reasoning_format.close_tag
                end = pending.find(tag)
                if end >= 0:
                    self.block_end = self.fed - len(pending) + end + len(tag)
                    reasoning += pending[:end].rstrip()
                    self.state, pending = "gap", pending[end + len(tag) :]
                else:
                    # held: a start of the closing tag, and the spaces before it (dropped
                    # if the tag follows, sent if more reasoning does)
                    keep = _tag_prefix_at_end(pending, tag)
                    body = pending[: len(pending) - keep]
                    keep += len(body) - len(body.rstrip())
                    reasoning += pending[: len(pending) - keep]
                    self.held, pending = pending[len(pending) - keep :], ""
            else:
                content, pending = content + pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held, at the end of the answer (an unfinished tag is text): the
        reasoning's last part, or the content's where the answer never opened a block."""
        held, self.held = self.held, ""
        if self.state == "start":
            self.state = "content"
            return "", held
        if self.in_reasoning:
            self.block_end = self.fed
        if self.state == "reasoning":
            return held.rstrip(), ""
        return "", ""


def split_reasoning(
    reasoning_format: ReasoningFormat, text: str, opens_in_prompt: bool = False
) -> tuple[str | None, str]:
    """A whole answer as (its reasoning, None where it has none; its content)."""
    splitter = reasoning_format.splitter(opens_in_prompt)
    reasoning, content = splitter.feed(text)
    last_reasoning, last_content = splitter.finish()
    return (reasoning + last_reasoning if splitter.thought else None), content + last_content


def _tag_prefix_at_end(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0 if none)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
