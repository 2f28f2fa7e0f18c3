"""POST /v1/completions: prompts as text, a list of texts, token ids or lists of token ids."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import text_prompt_ids
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
    admit,
    sse_response,
    usage_of,
    validate_prompts,
)


async def create_completion(request: Request) -> Response:
    gateway, body, engine = await admit(request, CompletionRequest)
    prompts = [
        p if isinstance(p, list) else text_prompt_ids(gateway.tokenizer, p) for p in body.prompts()
    ]
    params = body.to_sampling_params(default_max_tokens=16)
    validate_prompts(engine, prompts, params, "prompt")
    gateway.check_capacity()
    per_choice = [p for p in prompts for _ in range(body.n)]  # choice i: prompt i // n
    job = Job(
        gateway,
        engine,
        random_id("cmpl"),
        per_choice,
        [q for _ in prompts for q in fan_out(params, body.n)],
    )
    want_logprobs = body.logprobs is not None
    if body.stream:
        events = _stream(job, gateway.model_name, want_logprobs, body.include_usage)
        return sse_response(events, gateway.config.shutdown_grace)
    async for _ in job.run():
        pass
    tokenizer = gateway.tokenizer
    response = CompletionResponse(
        id=job.request_id,
        created=int(time.time()),
        model=gateway.model_name,
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
