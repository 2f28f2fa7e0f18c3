"""Streaming text that may turn out to be tool calls.

With tools offered, a choice whose text starts with '<' is writing calls (the tool grammar
lets a text answer start with anything else): that text is held back until the choice ends
and then read as calls; any other text streams as it comes.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import ParsedToolCall, parse_tool_calls


@dataclass(slots=True)
class ToolCallText:
    held: str | None  # the text held back so far; None: the text streams through

    @classmethod
    def of(cls, uses_tools: bool) -> ToolCallText:
        return cls("" if uses_tools else None)

    def feed(self, text: str) -> str:
        """The part of `text` to stream now ("" while it may still be a call)."""
        if self.held is None:
            return text
        pending = self.held + text
        is_call = pending.lstrip().startswith("<")
        self.held = pending if is_call or not pending.strip() else None
        return "" if self.held is not None else pending

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """At the end: the held text that is not calls (to stream last), and the calls."""
        content, calls = parse_tool_calls(self.held or "")
        self.held = None
        return content or "", calls
