"""POST /v1/completions: prompts as text, a list of texts, token ids or lists of token ids."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import AsyncEngine, EngineRequest, SamplingParams, text_prompt_ids
from gateway.admission import Admitted, admit, gateway_of
from gateway.generation import Job, fan_out
from gateway.logprobs import completion_logprobs
from gateway.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
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


async def create_completion(request: Request) -> Response:
    admitted = await admit(request, CompletionRequest)
    return await respond(admitted.ticket, _respond(request, admitted))


async def _respond(request: Request, admitted: Admitted[CompletionRequest]) -> Response:
    gateway, body = gateway_of(request), admitted.body
    engine = gateway.ready_engine()
    prepared = await gateway.run_blocking(_prepare, engine, body)
    per_choice = [r for p in prepared for r in fan_out(p, body.n)]  # choice i: prompt i // n
    job = Job(gateway, engine, admitted.ticket, random_id("cmpl"), per_choice)
    want_logprobs = body.logprobs is not None
    if body.stream:
        events = _stream(job, gateway.model_name, want_logprobs, body.include_usage)
        return sse_response(events, gateway, admitted.ticket)
    return await unless_disconnected(request, _complete(job, gateway.model_name, want_logprobs))


def _prepare(engine: AsyncEngine, body: CompletionRequest) -> list[EngineRequest]:
    """Tokenize the text prompts (worker pool); token id prompts go as they are."""
    prompts = [
        p if isinstance(p, list) else text_prompt_ids(engine.tokenizer, p) for p in body.prompts()
    ]

    def params_for(prompt: list[int]) -> SamplingParams:
        return body.to_sampling_params(engine.prefix_contract(prompt))

    return prepare_requests(
        engine, prompts, params_for, "prompt", body.cache_salt, body.grammar_field
    )


async def _complete(job: Job, model: str, want_logprobs: bool) -> JSONResponse:
    await job.collect()
    tokenizer = job.gateway.tokenizer
    response = CompletionResponse(
        id=job.request_id,
        created=int(time.time()),
        model=model,
        choices=[
            CompletionChoice(
                index=c.index,
                text=c.text,
                finish_reason=api_finish_reason(c.finish_reason) or "stop",
                logprobs=completion_logprobs(tokenizer, c.logprobs) if want_logprobs else None,
            )
            for c in job.choices
        ],
        usage=usage_of(job),
    )
    return JSONResponse(response.model_dump(mode="json"))


async def _stream(
    job: Job, model: str, want_logprobs: bool, include_usage: bool
) -> AsyncIterator[str]:
    tokenizer = job.gateway.tokenizer
    chunk = StreamChunks(CompletionStreamResponse, job.request_id, model)

    offsets = [0] * len(job.choices)
    async for choice, out in job.run():
        logprobs = None
        if want_logprobs:
            logprobs = completion_logprobs(tokenizer, out.logprobs or [], offsets[choice.index])
        offsets[choice.index] += len(out.text)
        if out.text or out.finished or logprobs is not None:
            yield chunk(
                [
                    CompletionStreamChoice(
                        index=choice.index,
                        text=out.text,
                        finish_reason=api_finish_reason(out.finish_reason),
                        logprobs=logprobs,
                    )
                ]
            )
    if include_usage:
        yield chunk([], usage=usage_of(job))
    yield SSE_DONE
