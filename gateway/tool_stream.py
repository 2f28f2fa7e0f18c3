"""Streaming text that may turn out to be tool calls.

With tools offered, a choice whose text starts as the model's calls start (its format's
`text_guard`: '<' of Hermes' `<tool_call>`, '{' of Llama 3's bare objects, Phi-4-mini's
`functools[`; the tool grammar lets a text answer start with anything else) is writing calls:
that text is held back until the choice ends and then read as calls; any other text streams
as soon as it cannot be their start.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import CallReader, ParsedToolCall


@dataclass(slots=True)
class ToolCallText:
    held: str | None  # the text held back so far; None: the text streams through
    reader: CallReader | None

    @classmethod
    def of(cls, reader: CallReader | None) -> ToolCallText:
        """`reader`: how calls are read; None where no tools are in use."""
        return cls("" if reader is not None else None, reader)

    def feed(self, text: str) -> str:
        """The part of `text` to stream now ("" while it may still be a call)."""
        if self.held is None:
            return text
        pending = self.held + text
        assert self.reader is not None
        # after a forced call's opening in the prompt every text is a call; otherwise (the
        # model may answer in text, or a thinking model's grammar writes the opening after
        # its think block) the text is held while it may still be the start of calls
        is_call = bool(self.reader.opening) or self.reader.tool_format.starts_calls(pending)
        self.held = pending if is_call is not False else None
        return "" if self.held is not None else pending

    def finish(self, is_cut: bool = False) -> tuple[str, list[ParsedToolCall]]:
        """At the end: the held text that is not calls (to stream last), and the calls.
        `is_cut`: the choice ended at the length limit (a call being written comes back
        with the arguments written so far: `ToolFormat.parse`)."""
        if self.reader is None:
            return "", []
        content, calls = self.reader.parse(self.held or "", is_cut)
        self.held = None
        return content or "", calls
