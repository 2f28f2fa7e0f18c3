"""POST /v1/completions: prompts as text, a list of texts, token ids or lists of token ids;
`echo` returns each prompt before its completion (with its tokens' logprobs when `logprobs`
is set: how evaluation harnesses score log-likelihoods, `max_tokens: 0` to score only), and
`suffix` asks a fill-in-the-middle model for what goes between prompt and suffix."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import (
    EngineRequest,
    SampleLogprobs,
    SamplingParams,
    fim_prompt_ids,
    text_prompt_ids,
)
from gateway.admission import Admitted, admit, gateway_of
from gateway.engine_client import EngineClient
from gateway.generation import Choice, Job, fan_out
from gateway.logprobs import completion_logprobs, echo_logprobs
from gateway.protocol import (
    CompletionChoice,
    CompletionLogprobs,
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
from gateway.tenants import Caller


@dataclass(frozen=True, slots=True)
class _Echo:
    """A choice's echoed prompt: the text as sent (token ids: decoded), and where each of its
    tokens starts in it (text prompts; None: counted from the tokens, see echo_logprobs)."""

    text: str
    starts: list[int] | None


@dataclass(frozen=True, slots=True)
class _Output:
    """How choices are written: with their echoed prompts (one per choice) or not."""

    model: str
    want_logprobs: bool
    echoes: list[_Echo] | None
    tokenizer: Any

    def text(self, choice_index: int, text: str, is_first: bool) -> str:
        return self.echoes[choice_index].text + text if self.echoes and is_first else text

    def logprobs(
        self,
        choice_index: int,
        samples: list[SampleLogprobs],
        prompt: tuple[list[int], list[SampleLogprobs | None] | None] | None,
        text_offsets: list[int],
    ) -> CompletionLogprobs | None:
        """The choice's logprobs; `prompt` (ids, their logprobs) leads the first chunk, and
        then the completion's offsets count the echoed prompt too."""
        if not self.want_logprobs:
            return None
        if prompt is None or not self.echoes:
            return completion_logprobs(self.tokenizer, samples, text_offsets)
        echo = self.echoes[choice_index]
        shift = len(echo.text)
        rest = completion_logprobs(self.tokenizer, samples, [o + shift for o in text_offsets])
        return echo_logprobs(self.tokenizer, *prompt, echo.starts).extended(rest)


async def create_completion(request: Request) -> Response:
    admitted = await admit(request, CompletionRequest)
    return await respond(admitted.ticket, _respond(request, admitted))


async def _respond(request: Request, admitted: Admitted[CompletionRequest]) -> Response:
    gateway, body = gateway_of(request), admitted.body
    engine = admitted.engine
    prepared, starts = await gateway.run_blocking(_prepare, engine, body, admitted.caller)
    per_choice = [r for p in prepared for r in fan_out(p, body.n)]  # choice i: prompt i // n
    job = Job(
        gateway,
        engine,
        admitted.ticket,
        random_id("cmpl"),
        per_choice,
        body.affinity_key,
        request.state.request_id,
    )
    echoes = _echoes(body, engine.tokenizer, starts) if body.echo else None
    output = _Output(gateway.model_name, body.logprobs is not None, echoes, gateway.tokenizer)
    if body.stream:
        return sse_response(_stream(job, output, body.include_usage), gateway, admitted.ticket)
    return await unless_disconnected(request, _complete(job, output))


def _prepare(
    engine: EngineClient, body: CompletionRequest, caller: Caller
) -> tuple[list[EngineRequest], list[list[int] | None]]:
    """Tokenize the text prompts (worker pool); token id prompts go as they are. With `echo`,
    each text prompt's token starts in it too (for `text_offset`)."""
    tokenizer = engine.tokenizer
    prompts, starts = [], []
    for prompt in body.prompts():
        if isinstance(prompt, str) and body.suffix is None and body.echo:
            encoded = tokenizer.encode_with_offsets(prompt)
            prompts.append(encoded.ids)
            starts.append(encoded.starts)
            continue
        prompts.append(
            fim_prompt_ids(tokenizer, prompt, body.suffix)
            if body.suffix is not None
            else prompt
            if isinstance(prompt, list)
            else text_prompt_ids(tokenizer, prompt)
        )
        starts.append(None)

    def params_for(prompt: list[int]) -> SamplingParams:
        return body.to_sampling_params(engine.prefix_contract(prompt, caller.tenant_name))

    requests = prepare_requests(
        engine, prompts, params_for, body.engine_fields, caller, body.cache_salt
    )
    return requests, starts


def _echoes(body: CompletionRequest, tokenizer: Any, starts: list[list[int] | None]) -> list[_Echo]:
    """Each choice's echoed prompt: the text as sent, or token ids decoded."""
    echoes = [
        _Echo(p if isinstance(p, str) else str(tokenizer.decode(p)), s)
        for p, s in zip(body.prompts(), starts, strict=True)
    ]
    return [echo for echo in echoes for _ in range(body.n)]


def _prompt_of(job: Job, choice: Choice) -> tuple[list[int], list[SampleLogprobs | None] | None]:
    return job.requests[choice.index].prompt_token_ids, choice.prompt_logprobs


async def _complete(job: Job, output: _Output) -> JSONResponse:
    await job.collect()
    response = CompletionResponse(
        id=job.request_id,
        created=int(time.time()),
        model=output.model,
        choices=[
            CompletionChoice(
                index=c.index,
                text=output.text(c.index, c.text, is_first=True),
                finish_reason=api_finish_reason(c.finish_reason) or "stop",
                logprobs=output.logprobs(c.index, c.logprobs, _prompt_of(job, c), c.text_offsets),
            )
            for c in job.choices
        ],
        usage=usage_of(job),
    )
    return JSONResponse(response.model_dump(mode="json"))


async def _stream(job: Job, output: _Output, include_usage: bool) -> AsyncIterator[str]:
    chunk = StreamChunks(CompletionStreamResponse, job.request_id, output.model)
    offsets = [0] * len(job.choices)  # characters of each choice's text sent so far
    started = [False] * len(job.choices)
    async for choice, out in job.run():
        index, is_first = choice.index, not started[choice.index]
        started[index] = True
        text = output.text(index, out.text, is_first)
        prompt = _prompt_of(job, choice) if is_first else None
        samples = out.logprobs or []
        # This output's tokens start where the text sent so far ends, each at its own place
        # in this output's text (on the first chunk, `output.logprobs` shifts them past the
        # echoed prompt).
        token_offsets = [offsets[index] + o for o in out.offsets()][: len(samples)]
        logprobs = output.logprobs(index, samples, prompt, token_offsets)
        offsets[index] += len(text)
        if text or out.finished or logprobs is not None:
            yield chunk(
                [
                    CompletionStreamChoice(
                        index=index,
                        text=text,
                        finish_reason=api_finish_reason(out.finish_reason),
                        logprobs=logprobs,
                    )
                ]
            )
    if include_usage:
        yield chunk([], usage=usage_of(job))
    yield SSE_DONE
