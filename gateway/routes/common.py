"""Pieces every route uses: the Gateway from app state, usage objects, SSE responses."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sse_starlette import EventSourceResponse
from starlette.requests import Request

from engine import AsyncEngine, EngineError, InvalidRequestError, SamplingParams
from gateway import errors
from gateway.generation import Job
from gateway.protocol import (
    ChatCompletionRequest,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionStreamResponse,
    UsageInfo,
)
from gateway.state import Gateway

logger = logging.getLogger(__name__)
SSE_DONE = "[DONE]"


GenerationRequest = TypeVar("GenerationRequest", ChatCompletionRequest, CompletionRequest)


async def admit(
    request: Request, body_type: type[GenerationRequest]
) -> tuple[Gateway, GenerationRequest, AsyncEngine]:
    """What every generation route starts with: key, body, readiness, model name."""
    gateway = gateway_of(request)
    gateway.check_auth(request)
    body = await errors.parse_body(request, body_type)
    engine = gateway.ready_engine()
    gateway.check_model(body.model)
    return gateway, body, engine


def validate_prompts(
    engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams, field: str
) -> None:
    """Check every prompt before any response starts. The engine calls the prompt "prompt";
    the error names the field this route read it from ("messages" or "prompt")."""
    for prompt in prompts:
        try:
            engine.validate_request(prompt, params)
        except InvalidRequestError as exc:
            if exc.param == "prompt":
                exc.param = field
            raise


def gateway_of(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def usage_of(job: Job) -> UsageInfo:
    return UsageInfo.from_counts(
        job.num_prompt_tokens, job.num_completion_tokens, job.num_cached_tokens
    )


@dataclass(frozen=True, slots=True)
class StreamChunks:
    """Serialises one stream's chunks, each repeating the stream's id, creation time, model."""

    response_type: type[ChatCompletionStreamResponse] | type[CompletionStreamResponse]
    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def __call__(self, choices: list[Any], usage: UsageInfo | None = None) -> str:
        body = self.response_type(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )
        return json.dumps(body.model_dump(mode="json"))


def sse_response(events: AsyncIterator[str], shutdown_grace: float) -> EventSourceResponse:
    """`data: ...` lines separated by blank lines, as OpenAI streams. A failure after the
    stream started can no longer change the status: it is sent as an error event. On SIGTERM
    the stream gets `shutdown_grace` seconds to finish before it is cut (sse-starlette would
    otherwise drain every open stream at once)."""

    async def guarded() -> AsyncIterator[dict[str, str]]:
        try:
            async for data in events:
                yield {"data": data}
        except EngineError as exc:
            logger.warning("stream failed: %s", exc)
            error = errors.from_engine_error(exc)
            yield {"data": json.dumps(error.body())}
            yield {"data": SSE_DONE}

    return EventSourceResponse(guarded(), sep="\n", ping=15, shutdown_grace_period=shutdown_grace)
