"""POST /v1/chat/completions: render the chat template once, stream or collect the choices."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import (
    CallReader,
    EngineRequest,
    GrammarSpec,
    InvalidRequestError,
    ParsedToolCall,
    PromptEnd,
    ReasoningFormat,
    ReasoningSplitter,
    ThinkFirst,
    answer_start_ids,
    split_reasoning,
)
from gateway.admission import Admitted, admit, gateway_of
from gateway.engine_client import EngineClient
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
from gateway.protocol.responses import CompletionTokensDetails, UsageInfo
from gateway.protocol.tools import FunctionCallOut, ToolCallDelta, ToolCallOut
from gateway.routes.common import (
    SSE_DONE,
    StreamChunks,
    chat_ids,
    prepare_requests,
    respond,
    sse_response,
    unless_disconnected,
    usage_of,
)
from gateway.tenants import Caller
from gateway.tool_stream import ToolCallText


async def create_chat_completion(request: Request) -> Response:
    admitted = await admit(request, ChatCompletionRequest)
    return await respond(admitted.ticket, _respond(request, admitted))


async def _respond(request: Request, admitted: Admitted[ChatCompletionRequest]) -> Response:
    gateway, body = gateway_of(request), admitted.body
    engine = admitted.engine
    prepared = await gateway.run_blocking(
        prepare_chat,
        engine,
        body,
        gateway.config.default_max_tokens,
        admitted.caller,
        gateway.reasoning_format,
    )
    job = Job(
        gateway,
        engine,
        admitted.ticket,
        random_id("chatcmpl"),
        fan_out(prepared.request, body.n),
        body.affinity_key,
        request.state.request_id,
    )
    reader, thinking = prepared.reader, prepared.thinking
    if body.stream:
        events = _stream(
            job, gateway.model_name, body.logprobs, body.include_usage, reader, thinking
        )
        return sse_response(events, gateway, admitted.ticket)
    completion = _complete(job, gateway.model_name, body.logprobs, reader, thinking)
    return await unless_disconnected(request, completion)


@dataclass(frozen=True, slots=True)
class Thinking:
    """How a thinking model's answers split into reasoning and content (None where the
    served model does not think): its markup, and where the prompt leaves the answer."""

    reasoning_format: ReasoningFormat
    prompt_end: PromptEnd

    @classmethod
    def of(
        cls, reasoning_format: ReasoningFormat | None, tokenizer: Any, prompt_ids: list[int]
    ) -> Thinking | None:
        if reasoning_format is None:
            return None
        return cls(reasoning_format, reasoning_format.prompt_end(tokenizer, prompt_ids))

    @property
    def opens_in_prompt(self) -> bool:
        return self.prompt_end == "opened"

    @property
    def think_first(self) -> ThinkFirst | None:
        """How a constraint on the answer lets it think first (None: it holds from the first
        token)."""
        return self.reasoning_format.think_first(self.prompt_end)

    def splitter(self) -> ReasoningSplitter:
        return self.reasoning_format.splitter(self.opens_in_prompt)

    def split(self, text: str) -> tuple[str | None, str]:
        return split_reasoning(self.reasoning_format, text, self.opens_in_prompt)

    def reasoning_tokens(self, choice: Choice) -> int:
        """The choice's tokens whose text starts inside its reasoning (the closing tag's),
        read by the same splitter (once more, over the whole answer, at its end)."""
        splitter = self.splitter()
        splitter.feed(choice.text)
        splitter.finish()
        end = splitter.block_end
        return 0 if end is None else sum(1 for start in choice.text_offsets if start < end)


def _usage(job: Job, thinking: Thinking | None) -> UsageInfo:
    usage = usage_of(job)
    if thinking is not None:
        count = sum(thinking.reasoning_tokens(choice) for choice in job.choices)
        usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=count)
    return usage


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """A chat request ready for the engine, and how its output is read: for calls (None
    where no tools are in use) and for reasoning (None where the model does not think)."""

    request: EngineRequest
    reader: CallReader | None
    thinking: Thinking | None


def prepare_chat(
    engine: EngineClient,
    body: ChatCompletionRequest,
    default_max_tokens: int,
    caller: Caller,
    reasoning_format: ReasoningFormat | None,
) -> PreparedChat:
    """Render and tokenize once (worker pool). Without a client max_tokens, a chat completion
    may write `default_max_tokens` (--default-max-tokens) or what is left of the context,
    whichever is less: never the whole context by accident, for n choices at once.

    A thinking model whose prompt leaves it free to think (or inside a think block) keeps
    its thinking under a constraint: the grammar holds from the block's end, and a forced
    call's opening is the grammar's to write after it rather than the prompt's."""
    prompt_ids = chat_ids(engine, body)
    thinking = Thinking.of(reasoning_format, engine.tokenizer, prompt_ids)
    think_first = thinking.think_first if thinking is not None else None
    reader = body.call_reader(opening_in_prompt=think_first is None)
    # A forced call's opening (`ToolFormat.opening`): no decode step, no share of max_tokens
    opening_ids = answer_start_ids(engine.tokenizer, reader.opening if reader else "")
    prompt_ids += opening_ids
    room = max(engine.max_model_len - len(prompt_ids), 1)
    contract = engine.prefix_contract(prompt_ids, caller.tenant_name)
    params = body.to_sampling_params(min(default_max_tokens, room), contract)
    if opening_ids:
        params = replace(params, num_grammar_prompt_tokens=len(opening_ids))
    if think_first is not None and params.grammar is not None:
        params = replace(params, grammar=params.grammar.after_thinking(think_first))
    try:
        [prepared] = prepare_requests(
            engine, [prompt_ids], lambda _: params, body.engine_fields, caller, body.cache_salt
        )
    except InvalidRequestError as exc:
        if exc.param == "tools":
            _blame_a_schema(engine, body)
        raise
    return PreparedChat(prepared, reader, thinking)


def _blame_a_schema(engine: EngineClient, body: ChatCompletionRequest) -> None:
    """The tools grammar holds every tool's parameters and the response format: when it does
    not compile, name the schema that does not on its own (else the grammar stays blamed)."""
    schemas = [
        (f"tools[{i}].function.parameters", GrammarSpec.json_schema(tool.function.parameters))
        for i, tool in enumerate(body.tools or [])
        if tool.function.parameters is not None
    ]
    answer = body.response_format.spec() if body.response_format is not None else None
    if answer is not None:
        schemas.append(("response_format", answer))
    for field, spec in schemas:
        try:
            engine.check_grammar(spec)
        except InvalidRequestError as exc:
            exc.param = field
            raise


async def _complete(
    job: Job,
    model: str,
    want_logprobs: bool,
    calls: CallReader | None,
    thinking: Thinking | None,
) -> JSONResponse:
    tokenizer = job.gateway.tokenizer
    await job.collect()
    response = ChatCompletionResponse(
        id=job.request_id,
        created=int(time.time()),
        model=model,
        choices=[_final_choice(c, tokenizer, want_logprobs, calls, thinking) for c in job.choices],
        usage=_usage(job, thinking),
    )
    return JSONResponse(response.model_dump(mode="json"))


def _final_choice(
    choice: Choice,
    tokenizer: object,
    want_logprobs: bool,
    reader: CallReader | None,
    thinking: Thinking | None,
) -> ChatCompletionResponseChoice:
    finish_reason = api_finish_reason(choice.finish_reason) or "stop"
    reasoning, text = thinking.split(choice.text) if thinking else (None, choice.text)
    content, calls = reader.parse(text, finish_reason == "length") if reader else (text, [])
    if reasoning is not None and not content:
        content = None  # it only thought (cut by the length limit, or it called tools)
    return ChatCompletionResponseChoice(
        index=choice.index,
        message=ChatMessageOut(
            role="assistant",
            content=content,
            reasoning_content=reasoning,
            tool_calls=[_call_out(call) for call in calls] or None,
        ),
        finish_reason="tool_calls" if calls and finish_reason == "stop" else finish_reason,
        logprobs=chat_logprobs(tokenizer, choice.logprobs) if want_logprobs else None,
    )


def _call_out(call: ParsedToolCall) -> ToolCallOut:
    return ToolCallOut(id=random_id("call"), function=_function(call))


async def _stream(
    job: Job,
    model: str,
    want_logprobs: bool,
    include_usage: bool,
    reader: CallReader | None,
    thinking: Thinking | None,
) -> AsyncIterator[str]:
    """Content deltas as they come; a thinking model's reasoning as `reasoning_content`
    deltas; with tools, text that turns out to be calls is held (gateway/tool_stream.py) and
    sent as tool-call deltas when its choice ends, each call whole."""
    tokenizer = job.engine.tokenizer
    chunk = StreamChunks(ChatCompletionStreamResponse, job.request_id, model)
    # a holder of text that may be calls only where tools are in use, a reasoning splitter
    # only where the model thinks: a plain stream's text passes through neither
    texts = [ToolCallText.of(reader) for _ in job.choices] if reader else None
    splitters = [thinking.splitter() for _ in job.choices] if thinking else None

    def delta(index: int, message: DeltaMessage, **fields: Any) -> str:
        return chunk([ChatCompletionStreamChoice(index=index, delta=message, **fields)])

    def parts(index: int, text: str) -> tuple[str, str]:
        reasoning, content = splitters[index].feed(text) if splitters else ("", text)
        return reasoning, texts[index].feed(content) if texts else content

    # The first delta of each choice carries the role; with tools in use its content is null,
    # as OpenAI's is before calls: an answer that is only calls must not come out as "" text
    # (the SDK's stream helper builds the message's content from these deltas).
    for choice in job.choices:
        yield delta(choice.index, DeltaMessage(role="assistant", content=None if reader else ""))
    async for choice, out in job.run():
        index = choice.index
        reasoning, text = parts(index, out.text)
        logprobs = chat_logprobs(tokenizer, out.logprobs or []) if want_logprobs else None
        if text or reasoning or logprobs is not None:
            message = DeltaMessage(
                content=text if text or not reasoning else None,  # "" with logprobs alone
                reasoning_content=reasoning or None,
            )
            yield delta(index, message, logprobs=logprobs)
        if out.finished:
            reason = api_finish_reason(out.finish_reason)
            last_reasoning, last_text = splitters[index].finish() if splitters else ("", "")
            held = texts[index].feed(last_text) if texts else last_text
            content, calls = texts[index].finish(reason == "length") if texts else ("", [])
            if last_reasoning:
                yield delta(index, DeltaMessage(reasoning_content=last_reasoning))
            if held + content:
                yield delta(index, DeltaMessage(content=held + content))
            if calls:
                deltas = [
                    ToolCallDelta(index=i, id=random_id("call"), function=_function(call))
                    for i, call in enumerate(calls)
                ]
                yield delta(index, DeltaMessage(tool_calls=deltas))
                reason = "tool_calls" if reason == "stop" else reason
            yield delta(index, DeltaMessage(), finish_reason=reason)
    if include_usage:
        yield chunk([], usage=_usage(job, thinking))
    yield SSE_DONE


def _function(call: ParsedToolCall) -> FunctionCallOut:
    return FunctionCallOut(name=call.name, arguments=call.arguments)
