"""Pieces every generation route uses: engine requests, usage objects, the two response kinds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from engine import (
    EngineRequest,
    InvalidRequestError,
    SamplingParams,
    chat_prompt_ids,
    text_prompt_ids,
)
from gateway import errors
from gateway.engine_client import EngineClient
from gateway.generation import Job
from gateway.protocol import (
    ChatCompletionRequest,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionStreamResponse,
    UsageInfo,
)
from gateway.state import Gateway
from gateway.tenants import Caller
from gateway.waiting import Ticket

SSE_DONE = "[DONE]"
T = TypeVar("T")


def chat_ids(engine: EngineClient, body: ChatCompletionRequest) -> list[int]:
    """A chat request's prompt as the model reads it: its messages and tools through the chat
    template, tokenized (worker pool). The one rendering every route that takes a chat body
    uses."""
    tools = body.tool_dicts() or None
    return chat_prompt_ids(
        engine.tokenizer,
        body.flat_messages(),
        tools=tools,
        template_kwargs=body.chat_template_kwargs,
    )


def chat_or_completion(
    body: dict[str, Any],
    chat: type[ChatCompletionRequest] = ChatCompletionRequest,
    completion: type[CompletionRequest] = CompletionRequest,
) -> ChatCompletionRequest | CompletionRequest:
    """A body that is a chat request or a completion request (either may carry the other's
    fields as unknown ones), as the schema documents the routes that take both (`chat` and
    `completion`: a route's own kinds of them). Tried in the order its keys suggest; when
    both fail, the error is the first kind's."""
    kinds: list[type[ChatCompletionRequest] | type[CompletionRequest]] = (
        [chat, completion] if "messages" in body else [completion, chat]
    )
    try:
        return errors.validate(kinds[0], body)
    except errors.OpenAIError:
        if "messages" not in body or "prompt" not in body:
            raise
        with contextlib.suppress(errors.OpenAIError):
            return errors.validate(kinds[1], body)
        raise


def first_prompt_ids(
    engine: EngineClient, request: ChatCompletionRequest | CompletionRequest
) -> tuple[str, list[int]]:
    """The request field its (first) prompt came from, and that prompt's token ids as the
    generation routes tokenize it (worker pool)."""
    if isinstance(request, ChatCompletionRequest):
        return "messages", chat_ids(engine, request)
    first = request.prompts()[0]
    return "prompt", first if isinstance(first, list) else text_prompt_ids(engine.tokenizer, first)


def prepare_requests(
    engine: EngineClient,
    prompts: list[list[int]],
    params_for: Callable[[list[int]], SamplingParams],
    fields: Mapping[str, str],
    caller: Caller | None = None,
    cache_salt: str | None = None,
) -> list[EngineRequest]:
    """One validated EngineRequest per prompt (each distinct prompt validated once), before
    any response starts; `params_for(prompt)` gives its parameters (they may depend on the
    registry entry it hits). The engine names its own parameters ("prompt", "max_tokens",
    "grammar"); `fields` maps them to the request fields they came from ("messages",
    "max_completion_tokens", "response_format", ...), which errors name. The caller's tenant
    and the request's `cache_salt` make the cache scope. Worker pool."""
    caller = caller or Caller()
    salt, tenant = caller.cache_salt(cache_salt), caller.tenant_name
    prepared: dict[tuple[int, ...], EngineRequest] = {}
    try:
        for prompt in prompts:
            key = tuple(prompt)
            if key not in prepared:
                prepared[key] = engine.prepare_request(prompt, params_for(prompt), salt, tenant)
    except InvalidRequestError as exc:
        exc.param = fields.get(exc.param or "", exc.param)
        raise
    return [prepared[tuple(prompt)] for prompt in prompts]


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


class TicketedStream(EventSourceResponse):
    """An SSE response that owns its request's ticket and closes it when the response ends,
    however it ends (finished, failed, client gone, never started)."""

    def __init__(self, events: AsyncIterator[dict[str, str]], ticket: Ticket) -> None:
        super().__init__(events, sep="\n", ping=15)
        self.ticket = ticket

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ticket.close()


def sse_response(events: AsyncIterator[str], gateway: Gateway, ticket: Ticket) -> TicketedStream:
    """`data: ...` lines separated by blank lines, as OpenAI streams. A failure after the
    stream started can no longer change the status: it is sent as an error event, then
    `[DONE]`, so clients always see the stream end (the drain on SIGTERM ends streams that
    outlive `--shutdown-grace` this way; a bug of ours ends it as a 500 would, logged)."""

    async def guarded() -> AsyncIterator[dict[str, str]]:
        try:
            async for data in events:
                yield {"data": data}
        except Exception as exc:
            error = errors.stream_error(exc, gateway.is_draining)
            yield {"data": json.dumps(error.body())}
            yield {"data": SSE_DONE}

    return TicketedStream(guarded(), ticket)


async def respond(ticket: Ticket, response: Awaitable[Response]) -> Response:
    """Await a generation route's response under its ticket: a stream takes the ticket over;
    anything else (a JSON body, an error) closes it here."""
    try:
        result = await response
    except BaseException:
        ticket.close()
        raise
    if not isinstance(result, TicketedStream):
        ticket.close()
    return result


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work` (a non-streaming generation) but cancel it as soon as the client goes
    away, so nobody's tokens are generated for nobody (the engine aborts cancelled requests
    and frees their blocks). The body was read already, so the next ASGI message can only be
    the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pending
    if task.cancelled():
        raise errors.ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
