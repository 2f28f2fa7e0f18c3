"""Engine logprobs -> the OpenAI shapes (chat: per-token objects; completions: parallel lists)."""

from __future__ import annotations

from typing import Any

from engine import SampleLogprobs
from gateway.protocol import (
    ChatCompletionLogprobs,
    ChatCompletionTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)


def _piece(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id]))


def chat_logprobs(tokenizer: Any, samples: list[SampleLogprobs]) -> ChatCompletionLogprobs:
    content = []
    for sample in samples:
        token = _piece(tokenizer, sample.token_id)
        top = [
            TopLogprob(
                token=(t := _piece(tokenizer, alt.token_id)),
                logprob=alt.logprob,
                bytes=list(t.encode()),
            )
            for alt in sample.top
        ]
        content.append(
            ChatCompletionTokenLogprob(
                token=token, logprob=sample.logprob, bytes=list(token.encode()), top_logprobs=top
            )
        )
    return ChatCompletionLogprobs(content=content)


def completion_logprobs(
    tokenizer: Any, samples: list[SampleLogprobs], text_offset: int = 0
) -> CompletionLogprobs:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for sample in samples:
        token = _piece(tokenizer, sample.token_id)
        tokens.append(token)
        token_logprobs.append(sample.logprob)
        tops.append({_piece(tokenizer, alt.token_id): alt.logprob for alt in sample.top})
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=tops, text_offset=offsets
    )
