"""A valid entry to the token ids the registry pins: the part of its rendering that real
requests continuing it share (chat templates and BPE are not prefix-stable on their own)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.core.errors import InvalidRequestError
from engine.registry.checks import Entry, field_at
from engine.registry.spec import Messages, PrefixSpec
from engine.text.chat import chat_prompt_ids, text_prompt_ids

if TYPE_CHECKING:
    from engine.text.tokenizer import Tokenizer

# User turns rendered after a chat prefix to find the ids it shares with real conversations.
# They differ in their first character and token, so nothing of a probe survives the
# common-prefix cut, and one holds digits and punctuation that BPE merges differently.
PROBE_USER_TEXTS = ("Hello", "Which way? 1 2 3")

# Continuations a completion prompt may add after a text prefix: a space-led word, a newline,
# punctuation. BPE can merge the prefix's last characters with any of them.
PROBE_TEXT_SUFFIXES = ("Hello", " Hello", "the", " the", "\nWhich way? 1 2 3", "?!")

_UNSTABLE_TEMPLATE = (
    "the chat template does not render this prefix stably: the messages followed by different "
    "user turns share no leading token"
)


def render_chat_prefix(tokenizer: Tokenizer, messages: Messages) -> list[int]:
    """The ids that `messages` followed by any user turn all start with, and (unless they
    are system messages only) `messages` rendered alone too.

    Chat templates are often not prefix-stable: the last message may be closed differently
    when nothing follows it, BPE may merge tokens across the boundary, and some render a
    system message only with the user turn it is folded into (Gemma's: rendered alone, the
    messages are `<bos>` and nothing else). Registering the naive rendering would then match
    no real request, or pin nothing of the prompt. The longest prefix common to renderings
    with several different probe user turns is what real conversations share (the opening of
    the user turn included, where the template writes one). An entry ending in a user or
    assistant turn may also be continued by the generation prompt or another role, so its
    rendering alone joins the comparison; a system prompt is always followed by a user turn.
    An empty result means the template renders the prefix unstably.
    """
    base = [{"role": role, "content": content} for role, content in messages]
    renderings = [
        chat_prompt_ids(tokenizer, [*base, {"role": "user", "content": probe}])
        for probe in PROBE_USER_TEXTS
    ]
    if any(role != "system" for role, _ in messages):
        renderings.append(chat_prompt_ids(tokenizer, base, add_generation_prompt=False))
    return _common_prefix(renderings)


def render_text_prefix(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids that `text` alone and `text` followed by typical continuations all start with,
    so a completion whose prompt extends the text still matches at the token level."""
    renderings = [text_prompt_ids(tokenizer, text)]
    renderings += [text_prompt_ids(tokenizer, text + suffix) for suffix in PROBE_TEXT_SUFFIXES]
    return _common_prefix(renderings)


def _common_prefix(sequences: Sequence[Sequence[int]]) -> list[int]:
    num_shared = 0
    for column in zip(*sequences, strict=False):
        if len(set(column)) != 1:
            break
        num_shared += 1
    return list(sequences[0][:num_shared])


def render_entry(
    entry: Entry, tokenizer: Tokenizer, max_model_len: int, problems: list[str]
) -> PrefixSpec | None:
    where = field_at(f"entry '{entry.name}'", "messages" if entry.kind == "chat" else "text")
    try:
        ids = _entry_ids(entry, tokenizer)
    except InvalidRequestError as exc:
        problems.append(f"{where}: {exc.message}")
        return None
    if not ids and entry.kind == "chat":
        problems.append(f"{where}: {_UNSTABLE_TEMPLATE}")
    elif not ids and entry.text.strip():
        problems.append(f"{where}: no token of this text is stable under continuation")
    elif not ids:
        problems.append(f"{where}: tokenizes to 0 tokens")
    elif len(ids) > max_model_len - 1:
        problems.append(
            f"{where}: {len(ids)} tokens, more than max_model_len - 1 = {max_model_len - 1} "
            "(a request must be able to add at least one token after the prefix)"
        )
    else:
        return PrefixSpec(
            entry.name,
            entry.description,
            entry.kind,
            entry.messages,
            entry.text,
            tuple(ids),
            entry.contract,
            entry.tenants,
        )
    return None


def _entry_ids(entry: Entry, tokenizer: Tokenizer) -> list[int]:
    if entry.kind == "chat":
        return render_chat_prefix(tokenizer, entry.messages)
    return render_text_prefix(tokenizer, entry.text)
