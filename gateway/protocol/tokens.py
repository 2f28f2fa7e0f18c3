"""Bodies of /tokenize and /detokenize (vLLM's and llama.cpp's routes): a client that sets
`logit_bias` or budgets a context needs the served tokenizer's ids, and only the server has
that tokenizer and its chat template."""

from __future__ import annotations

from pydantic import BaseModel

from gateway.protocol.common import RequestModel
from gateway.protocol.requests import ChatCompletionRequest, CompletionRequest


class TokenizeChatRequest(ChatCompletionRequest):
    """A chat body for /tokenize; `model` may be left out (the served one), as on vLLM's."""

    model: str | None = None  # type: ignore[assignment]


class TokenizeCompletionRequest(CompletionRequest):
    """A completion body for /tokenize; `model` may be left out (the served one)."""

    model: str | None = None  # type: ignore[assignment]


class TokenizeResponse(BaseModel):
    """The prompt as the model reads it: a chat body's messages and tools through the chat
    template, a completion body's (first) prompt as /v1/completions tokenizes it."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str]  # each id's vocabulary entry (byte-level pieces as the file has them)


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str  # special tokens included
