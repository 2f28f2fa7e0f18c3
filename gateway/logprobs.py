"""Engine logprobs -> the OpenAI shapes (chat: per-token objects; completions: parallel lists).

A streamed token with `top_logprobs: 20` names 21 tokens; decoding each with the tokenizer on
the event loop, token after token, stream after stream, is what `TokenPieces` avoids: every
token's text and bytes are decoded once per tokenizer, in the worker pool when the engine
comes up (`Gateway.start`), and looked up after that.
"""

from __future__ import annotations

import codecs
import functools
import re
from dataclasses import dataclass
from typing import Any

from engine import SampleLogprobs
from gateway.protocol import (
    ChatCompletionLogprobs,
    ChatCompletionTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)


@dataclass(frozen=True, slots=True)
class TokenPieces:
    """Every token id's logprob text and bytes, for one tokenizer (ids past its length, which
    a model's padded vocabulary can sample, are decoded when asked)."""

    pieces: list[str]
    raw: list[bytes]


@functools.lru_cache(maxsize=4)
def token_pieces(tokenizer: Any) -> TokenPieces:
    """Built once per tokenizer (~0.5 s for a 49k vocabulary): call it off the event loop."""
    ids = range(len(tokenizer))
    return TokenPieces(
        [_decode_piece(tokenizer, i) for i in ids], [_bytes(tokenizer, i) for i in ids]
    )


def _piece(tokenizer: Any, token_id: int) -> str:
    table = token_pieces(tokenizer)
    return (
        table.pieces[token_id]
        if token_id < len(table.pieces)
        else _decode_piece(tokenizer, token_id)
    )


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The exact bytes a token stands for (byte-level BPE, SentencePiece byte fallback, or
    plain text), which clients join to rebuild text that tokens split mid-character."""
    table = token_pieces(tokenizer)
    return table.raw[token_id] if token_id < len(table.raw) else _bytes(tokenizer, token_id)


def _decode_piece(tokenizer: Any, token_id: int) -> str:
    """The token as text; a token holding part of a multi-byte character is written as its
    bytes, OpenAI style ("bytes:\\xe6\\x97"), so distinct tokens never share a key."""
    text = str(tokenizer.decode([token_id]))
    if "\ufffd" not in text:
        return text
    raw = _bytes(tokenizer, token_id)
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _bytes(tokenizer: Any, token_id: int) -> bytes:
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
    tokenizer: Any, samples: list[SampleLogprobs], text_offsets: list[int]
) -> CompletionLogprobs:
    """`text_offsets`: where each token's text starts in the response's `text`, as the
    detokenizer emitted it (a token that ends mid-character starts where the character's
    emitted text does; bytes that are not UTF-8 count as the replacement character written)."""
    entries: list[tuple[int, SampleLogprobs | None]] = [(s.token_id, s) for s in samples]
    return _legacy_logprobs(tokenizer, entries, text_offsets)


def echo_logprobs(
    tokenizer: Any,
    prompt_ids: list[int],
    prompt_logprobs: list[SampleLogprobs | None] | None,
    starts: list[int] | None = None,
) -> CompletionLogprobs:
    """An echoed prompt's tokens; the first has null logprobs, as nothing precedes it.
    `starts`: where each token begins in the echoed text, for a text prompt as sent
    (`Tokenizer.encode_with_offsets`: a BOS the tokenizer added takes none of it). Without
    them (token ids, echoed as their decoded text) offsets count the characters the prompt's
    bytes decode to (a split character once complete)."""
    scored = prompt_logprobs or [None] * len(prompt_ids)
    offsets = starts
    if offsets is None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        offsets, num_chars = [], 0
        for token_id in prompt_ids:
            offsets.append(num_chars)
            num_chars += len(decoder.decode(token_bytes(tokenizer, token_id)))
    entries = list(zip(prompt_ids, scored, strict=True))
    return _legacy_logprobs(tokenizer, entries, offsets)


def _legacy_logprobs(
    tokenizer: Any, entries: list[tuple[int, SampleLogprobs | None]], offsets: list[int]
) -> CompletionLogprobs:
    tokens = [_piece(tokenizer, token_id) for token_id, _ in entries]
    token_logprobs = [s.logprob if s is not None else None for _, s in entries]
    tops = [_top_logprobs(tokenizer, s) if s is not None else None for _, s in entries]
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets
    )


def _top_logprobs(tokenizer: Any, sample: SampleLogprobs) -> dict[str, float]:
    """The legacy API's top alternatives, and the token itself among them wherever they left
    it out (OpenAI: "the API will always return the logprob of the sampled token, so there
    may be up to logprobs+1 elements")."""
    top = {_piece(tokenizer, alt.token_id): alt.logprob for alt in sample.top}
    top.setdefault(_piece(tokenizer, sample.token_id), sample.logprob)
    return top
