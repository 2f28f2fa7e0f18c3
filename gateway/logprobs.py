"""Engine logprobs -> the OpenAI shapes (chat: per-token objects; completions: parallel lists)."""

from __future__ import annotations

import functools
import re
from typing import Any

from engine import SampleLogprobs
from gateway.protocol import (
    ChatCompletionLogprobs,
    ChatCompletionTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)


def _piece(tokenizer: Any, token_id: int) -> str:
    """The token as text; a token holding part of a multi-byte character is written as its
    bytes, OpenAI style ("bytes:\\xe6\\x97"), so distinct tokens never share a key."""
    text = str(tokenizer.decode([token_id]))
    if "\ufffd" not in text:
        return text
    raw = token_bytes(tokenizer, token_id)
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The exact bytes a token stands for (byte-level BPE, SentencePiece byte fallback, or
    plain text), which clients join to rebuild text that tokens split mid-character."""
    token = tokenizer.convert_ids_to_tokens(token_id)
    fallback = _BYTE_FALLBACK.fullmatch(token)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    decoder = _byte_level_decoder()
    if all(ch in decoder for ch in token):
        return bytes(decoder[ch] for ch in token)
    return str(token).replace("\u2581", " ").encode()


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table, inverted."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def chat_logprobs(tokenizer: Any, samples: list[SampleLogprobs]) -> ChatCompletionLogprobs:
    content = []
    for sample in samples:
        top = [
            TopLogprob(
                token=_piece(tokenizer, alt.token_id),
                logprob=alt.logprob,
                bytes=list(token_bytes(tokenizer, alt.token_id)),
            )
            for alt in sample.top
        ]
        content.append(
            ChatCompletionTokenLogprob(
                token=_piece(tokenizer, sample.token_id),
                logprob=sample.logprob,
                bytes=list(token_bytes(tokenizer, sample.token_id)),
                top_logprobs=top,
            )
        )
    return ChatCompletionLogprobs(content=content)


def completion_logprobs(
    tokenizer: Any, samples: list[SampleLogprobs], text_offset: int = 0
) -> CompletionLogprobs:
    """`text_offset` of a token: characters of completed text before it (a token that ends
    mid-character adds nothing until the character is complete)."""
    return _legacy_logprobs(tokenizer, [(s.token_id, s) for s in samples], text_offset)


def echo_logprobs(
    tokenizer: Any, prompt_ids: list[int], prompt_logprobs: list[SampleLogprobs | None] | None
) -> CompletionLogprobs:
    """An echoed prompt's tokens; the first has null logprobs, as nothing precedes it."""
    scored = prompt_logprobs or [None] * len(prompt_ids)
    return _legacy_logprobs(tokenizer, list(zip(prompt_ids, scored, strict=True)), 0)


def _legacy_logprobs(
    tokenizer: Any, entries: list[tuple[int, SampleLogprobs | None]], text_offset: int
) -> CompletionLogprobs:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    emitted = b""
    for token_id, sample in entries:
        tokens.append(_piece(tokenizer, token_id))
        token_logprobs.append(sample.logprob if sample is not None else None)
        tops.append(
            {_piece(tokenizer, alt.token_id): alt.logprob for alt in sample.top}
            if sample is not None
            else None
        )
        offsets.append(text_offset + len(emitted.decode("utf-8", errors="ignore")))
        emitted += token_bytes(tokenizer, token_id)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets
    )
