"""POST /v1/chat/completions: render the chat template once, stream or collect the choices."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import AsyncEngine, EngineRequest, chat_prompt_ids
from gateway.admission import Admitted, admit, gateway_of
from gateway.generation import Choice, Job, fan_out
from gateway.logprobs import chat_logprobs
from gateway.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessageOut,
    DeltaMessage,
    api_finish_reason,
    random_id,
)
from gateway.routes.common import (
    SSE_DONE,
    StreamChunks,
    prepare_requests,
    respond,
    sse_response,
    unless_disconnected,
    usage_of,
)


async def create_chat_completion(request: Request) -> Response:
    admitted = await admit(request, ChatCompletionRequest)
    return await respond(admitted.ticket, _respond(request, admitted))


async def _respond(request: Request, admitted: Admitted[ChatCompletionRequest]) -> Response:
    gateway, body = gateway_of(request), admitted.body
    engine = gateway.ready_engine()
    prepared = await gateway.run_blocking(_prepare, engine, body, gateway.config.default_max_tokens)
    job = Job(gateway, engine, admitted.ticket, random_id("chatcmpl"), fan_out(prepared, body.n))
    if body.stream:
        events = _stream(job, gateway.model_name, body.logprobs, body.include_usage)
        return sse_response(events, gateway, admitted.ticket)
    return await unless_disconnected(request, _complete(job, gateway.model_name, body.logprobs))


def _prepare(
    engine: AsyncEngine, body: ChatCompletionRequest, default_max_tokens: int
) -> EngineRequest:
    """Render and tokenize once (worker pool). Without a client max_tokens, a chat completion
    may write `default_max_tokens` (--default-max-tokens) or what is left of the context,
    whichever is less: never the whole context by accident, for n choices at once."""
    prompt_ids = chat_prompt_ids(engine.tokenizer, body.flat_messages())
    room = max(engine.max_model_len - len(prompt_ids), 1)
    contract = engine.prefix_contract(prompt_ids)
    params = body.to_sampling_params(min(default_max_tokens, room), contract)
    [prepared] = prepare_requests(
        engine, [prompt_ids], lambda _: params, "messages", body.cache_salt, body.grammar_field
    )
    return prepared


async def _complete(job: Job, model: str, want_logprobs: bool) -> JSONResponse:
    tokenizer = job.gateway.tokenizer
    await job.collect()
    response = ChatCompletionResponse(
        id=job.request_id,
        created=int(time.time()),
        model=model,
        choices=[_final_choice(c, tokenizer, want_logprobs) for c in job.choices],
        usage=usage_of(job),
    )
    return JSONResponse(response.model_dump(mode="json"))


def _final_choice(
    choice: Choice, tokenizer: object, want_logprobs: bool
) -> ChatCompletionResponseChoice:
    return ChatCompletionResponseChoice(
        index=choice.index,
        message=ChatMessageOut(role="assistant", content=choice.text),
        finish_reason=api_finish_reason(choice.finish_reason) or "stop",
        logprobs=chat_logprobs(tokenizer, choice.logprobs) if want_logprobs else None,
    )


async def _stream(
    job: Job, model: str, want_logprobs: bool, include_usage: bool
) -> AsyncIterator[str]:
    tokenizer = job.gateway.tokenizer
    chunk = StreamChunks(ChatCompletionStreamResponse, job.request_id, model)

    for choice in job.choices:  # the first delta of each choice carries the role
        yield chunk(
            [
                ChatCompletionStreamChoice(
                    index=choice.index, delta=DeltaMessage(role="assistant", content="")
                )
            ]
        )
    async for choice, out in job.run():
        logprobs = chat_logprobs(tokenizer, out.logprobs or []) if want_logprobs else None
        if out.text or logprobs is not None:
            yield chunk(
                [
                    ChatCompletionStreamChoice(
                        index=choice.index, delta=DeltaMessage(content=out.text), logprobs=logprobs
                    )
                ]
            )
        if out.finished:
            yield chunk(
                [
                    ChatCompletionStreamChoice(
                        index=choice.index,
                        delta=DeltaMessage(),
                        finish_reason=api_finish_reason(out.finish_reason),
                    )
                ]
            )
    if include_usage:
        yield chunk([], usage=usage_of(job))
    yield SSE_DONE
