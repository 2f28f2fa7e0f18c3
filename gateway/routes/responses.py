"""The Responses API: `POST /v1/responses` (streamed as typed events or not), and the kept
responses behind `GET` / `DELETE /v1/responses/{id}`.

A response runs as the chat completion it describes (protocol/responses_request.py): the
previous response's conversation, if chained, comes from the response store; its output
text and tool calls become output items; a stored response keeps the whole conversation so
that the next turn can continue it.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import CallReader, InvalidRequestError, ReasoningFormat, ToolFormat
from gateway import errors
from gateway.admission import Admitted, admit, gateway_of
from gateway.engine_client import EngineClient
from gateway.generation import Job
from gateway.logprobs import chat_logprobs
from gateway.protocol import ChatCompletionRequest
from gateway.protocol.response_objects import (
    DeletedResponse,
    FunctionCallOutput,
    IncompleteDetails,
    OutputLogprob,
    OutputMessage,
    OutputText,
    ReasoningOutput,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponseStatus,
    ResponseUsage,
)
from gateway.protocol.responses_request import NamedFunctionChoice, ResponsesRequest
from gateway.response_store import ResponseStore, StoredResponse
from gateway.routes.chat import PreparedChat, Thinking, prepare_chat
from gateway.routes.common import TicketedStream, respond, unless_disconnected
from gateway.state import Gateway
from gateway.tenants import Caller
from gateway.tool_stream import ToolCallText

# Chat fields -> where a Responses request has them.
_FIELDS = {
    "messages": "input",
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
}


async def create_response(request: Request) -> Response:
    admitted = await admit(request, ResponsesRequest)
    return await respond(admitted.ticket, _respond(request, admitted))


async def stored_response(request: Request) -> Response:
    """GET: the kept response, as it was returned; DELETE: forget it."""
    gateway = gateway_of(request)
    caller = gateway.check_auth(request)
    stored = await _stored(gateway.responses, request.path_params["id"], "id", caller)
    if request.method == "GET":
        return JSONResponse(stored.response)
    await gateway.responses.delete(stored.response["id"])
    return JSONResponse(DeletedResponse(id=stored.response["id"]).model_dump(mode="json"))


async def _respond(request: Request, admitted: Admitted[ResponsesRequest]) -> Response:
    gateway, body = gateway_of(request), admitted.body
    engine = admitted.engine
    caller = admitted.caller
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = await _stored(
            gateway.responses, body.previous_response_id, "previous_response_id", caller
        )
        history = list(previous.conversation)
    _check_outputs_answer_calls(body, history)
    prepared = await gateway.run_blocking(
        _prepare,
        engine,
        body,
        history,
        gateway.config.default_max_tokens,
        caller,
        gateway.tool_format,
        gateway.reasoning_format,
    )
    draft = _draft(body, gateway.model_name)
    job = Job(
        gateway,
        engine,
        admitted.ticket,
        draft.id,
        [prepared.request],
        body.affinity_key,
        request.state.request_id,
    )
    run = ResponseRun(
        job, draft, body, history, caller.tenant_name, prepared.reader, prepared.thinking
    )
    if body.stream:
        return TicketedStream(_stream(run, gateway), admitted.ticket)
    return await unless_disconnected(request, _complete(run))


async def _stored(
    store: ResponseStore, response_id: str, param: str, caller: Caller
) -> StoredResponse:
    """The kept response, if the caller may see it: another tenant's reads as unknown."""
    stored = await store.get(response_id)
    if stored is None or (stored.owner != caller.tenant_name and not caller.is_admin):
        raise errors.OpenAIError(
            404,
            f"No response with id '{response_id}' is kept here: it was never stored "
            "('store': false), or it expired or was evicted (see --response-store-ttl and "
            "--response-store-entries).",
            param=param,
            code="response_not_found",
        )
    return stored


def _check_outputs_answer_calls(body: ResponsesRequest, history: list[dict[str, Any]]) -> None:
    """Each function_call_output answers a function_call made before it, in this input or in
    the chained responses (as OpenAI requires)."""
    called = {call["id"] for message in history for call in message.get("tool_calls") or ()}
    for index, item in enumerate(body.input):
        if item.type == "function_call":
            called.add(item.call_id or "")
        elif item.type == "function_call_output" and item.call_id not in called:
            param = f"input[{index}].call_id"
            raise errors.OpenAIError(
                400,
                f"Invalid value for '{param}': '{item.call_id}' is not the call_id of a "
                "function_call made before it (in 'input' or the previous response).",
                param=param,
                code="invalid_value",
            )


def _prepare(
    engine: EngineClient,
    body: ResponsesRequest,
    history: list[dict[str, Any]],
    default_max_tokens: int,
    caller: Caller,
    tool_format: ToolFormat,
    reasoning_format: ReasoningFormat | None,
) -> PreparedChat:
    """The chat request this response is, prepared as chats are (worker pool), its tools
    in the served model's `tool_format`; errors name the Responses fields."""
    chat = errors.validate(
        ChatCompletionRequest, body.chat_payload(history), {"tool_format": tool_format}
    )
    try:
        return prepare_chat(engine, chat, default_max_tokens, caller, reasoning_format)
    except InvalidRequestError as exc:
        if exc.param is not None:
            param = exc.param.replace(".function.parameters", ".parameters")
            exc.param = _FIELDS.get(param, param)
        exc.message = exc.message.replace("max_tokens", "max_output_tokens")
        raise


def _draft(body: ResponsesRequest, model: str) -> ResponseObject:
    """The response as it starts: in progress, the request's settings echoed."""
    choice = body.tool_choice
    if isinstance(choice, NamedFunctionChoice):
        choice = choice.model_dump()
    text_format = body.text.format if body.text is not None else None
    return ResponseObject(
        model=model,
        instructions=body.instructions,
        previous_response_id=body.previous_response_id,
        max_output_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_logprobs=body.top_logprobs,
        tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []],
        tool_choice=choice or "auto",
        parallel_tool_calls=body.parallel_tool_calls is not False,
        text={
            "format": (
                text_format.model_dump(by_alias=True, exclude_none=True)
                if text_format is not None
                else {"type": "text"}
            )
        },
        store=body.store,
        metadata=body.metadata or {},
        user=body.user,
    )


Event = tuple[str, dict[str, Any]]


@dataclass
class ResponseRun:
    """One response being generated. `events()` yields its stream events as they happen
    (type, fields); once it is exhausted, `response` is final (and stored if asked)."""

    job: Job
    response: ResponseObject
    body: ResponsesRequest
    history: list[dict[str, Any]]
    owner: str | None  # the tenant that may continue or fetch it
    calls: CallReader | None  # how calls are read from the output; None: no tools
    thinking: Thinking | None = None  # how a thinking model's reasoning is split off
    reasoning: ReasoningOutput | None = None
    reasoning_text: str = ""
    message: OutputMessage | None = None
    text: str = ""
    logprobs: list[OutputLogprob] = field(default_factory=list)

    async def events(self) -> AsyncIterator[Event]:
        response = self.response
        yield "response.created", {"response": response}
        yield "response.in_progress", {"response": response}
        splitter = self.thinking.splitter() if self.thinking else None
        calls_or_text = ToolCallText.of(self.calls)
        held_logprobs: list[OutputLogprob] = []  # of text held back: it may be calls
        async for _, out in self.job.run():
            reasoning, answer = splitter.feed(out.text) if splitter else ("", out.text)
            for event in self._reasoning(reasoning, closes=bool(answer)):
                yield event
            text = calls_or_text.feed(answer)
            # a reasoning token's logprobs have no place in the answer's
            if answer or not (reasoning or (splitter is not None and splitter.in_reasoning)):
                held_logprobs += self._logprobs(out.logprobs or [])
            if calls_or_text.held is None:
                for event in self._text(text, held_logprobs):
                    yield event
                held_logprobs = []
        choice = self.job.choices[0]
        status: ResponseStatus = "incomplete" if choice.finish_reason == "length" else "completed"
        reasoning, answer = splitter.finish() if splitter else ("", "")
        for event in self._reasoning(reasoning, closes=True, status=status):
            yield event
        held = calls_or_text.feed(answer)
        content, calls = calls_or_text.finish(status == "incomplete")
        for event in self._text(held + content, [] if calls else held_logprobs):
            yield event
        if self.message is None and not calls:  # an empty answer is still a message
            for event in self._open_message():
                yield event
        if self.message is not None:
            for event in self._close_message(status):
                yield event
        for call in calls:
            item = FunctionCallOutput(name=call.name, arguments="", status="in_progress")
            index = len(response.output)
            response.output.append(item)
            where = {"item_id": item.id, "output_index": index}
            yield "response.output_item.added", {"output_index": index, "item": item}
            yield "response.function_call_arguments.delta", {**where, "delta": call.arguments}
            # a call the length limit cut comes back with what was written, incomplete
            item.arguments = call.arguments
            item.status = "completed" if call.is_complete else "incomplete"
            yield (
                "response.function_call_arguments.done",
                {
                    **where,
                    "name": call.name,
                    "arguments": call.arguments,
                },
            )
            yield "response.output_item.done", {"output_index": index, "item": item}
        response.status = status
        if status == "incomplete":
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        else:
            response.completed_at = int(time.time())
        job = self.job
        response.usage = ResponseUsage.from_counts(
            job.num_prompt_tokens,
            job.num_completion_tokens,
            job.num_cached_tokens,
            job.num_cache_written_tokens,
        )
        if self.thinking is not None:
            reasoning_tokens = self.thinking.reasoning_tokens(choice)
            response.usage.output_tokens_details.reasoning_tokens = reasoning_tokens
        await self._store()
        yield f"response.{status}", {"response": response}

    def _reasoning(self, text: str, closes: bool, status: str = "completed") -> list[Event]:
        """The reasoning item's events: opened by its first text, closed once the answer
        starts (or the output ends: `status` "incomplete" where the limit cut it)."""
        events: list[Event] = []
        if text and self.reasoning is None:
            self.reasoning = ReasoningOutput(status="in_progress")
            index = len(self.response.output)
            self.response.output.append(self.reasoning)
            events.append(
                ("response.output_item.added", {"output_index": index, "item": self.reasoning})
            )
        item = self.reasoning
        if item is None or item.status != "in_progress":
            return events
        where = {
            "item_id": item.id,
            "output_index": self.response.output.index(item),
            "content_index": 0,
        }
        if text:
            self.reasoning_text += text
            events.append(("response.reasoning_text.delta", {**where, "delta": text}))
        if closes:
            item.content = [ReasoningText(text=self.reasoning_text)]
            # open at the output's end only where the limit cut it inside the block
            item.status = "incomplete" if status == "incomplete" else "completed"
            events.append(("response.reasoning_text.done", {**where, "text": self.reasoning_text}))
            events.append(
                ("response.output_item.done", {"output_index": where["output_index"], "item": item})
            )
        return events

    def _logprobs(self, samples: list[Any]) -> list[OutputLogprob]:
        if not self.body.wants_logprobs:
            return []
        converted = chat_logprobs(self.job.gateway.tokenizer, samples).content or []
        return [OutputLogprob.model_validate(entry.model_dump()) for entry in converted]

    def _text(self, text: str, logprobs: list[OutputLogprob]) -> list[Event]:
        if not text and not logprobs:
            return []
        events = self._open_message() if self.message is None else []
        assert self.message is not None
        self.text += text
        self.logprobs += logprobs
        events.append(
            (
                "response.output_text.delta",
                {**self._where(), "delta": text, "logprobs": logprobs},
            )
        )
        return events

    def _open_message(self) -> list[Event]:
        self.message = OutputMessage(status="in_progress")
        index = len(self.response.output)
        self.response.output.append(self.message)
        part = OutputText(text="")
        return [
            ("response.output_item.added", {"output_index": index, "item": self.message}),
            ("response.content_part.added", {**self._where(), "part": part}),
        ]

    def _close_message(self, status: str) -> list[Event]:
        assert self.message is not None
        part = OutputText(
            text=self.text, logprobs=self.logprobs if self.body.wants_logprobs else None
        )
        self.message.content = [part]
        self.message.status = "incomplete" if status == "incomplete" else "completed"
        index = self.response.output.index(self.message)
        return [
            (
                "response.output_text.done",
                {**self._where(), "text": self.text, "logprobs": self.logprobs},
            ),
            ("response.content_part.done", {**self._where(), "part": part}),
            ("response.output_item.done", {"output_index": index, "item": self.message}),
        ]

    def _where(self) -> dict[str, Any]:
        assert self.message is not None
        index = self.response.output.index(self.message)
        return {"item_id": self.message.id, "output_index": index, "content_index": 0}

    async def _store(self) -> None:
        if not self.body.store:
            return
        answer: dict[str, Any] = {"role": "assistant", "content": self.text or None}
        if self.reasoning is not None:  # a template may write the last turn's reasoning back
            answer["reasoning_content"] = self.reasoning_text
        calls = [item for item in self.response.output if isinstance(item, FunctionCallOutput)]
        if calls:
            answer["tool_calls"] = [_chat_call(item) for item in calls]
        conversation = [*self.history, *self.body.input_messages(), answer]
        store = self.job.gateway.responses
        await store.put(self.response.model_dump(mode="json"), conversation, self.owner)


def _chat_call(item: FunctionCallOutput) -> dict[str, Any]:
    return {
        "id": item.call_id,
        "type": "function",
        "function": {"name": item.name, "arguments": item.arguments},
    }


async def _complete(run: ResponseRun) -> JSONResponse:
    async for _ in run.events():
        pass
    return JSONResponse(run.response.model_dump(mode="json"))


async def _stream(run: ResponseRun, gateway: Gateway) -> AsyncIterator[dict[str, str]]:
    """The events as SSE (`event:` the type, `data:` the event with its sequence number). A
    failure once the stream has started ends it with `response.failed`, as OpenAI does."""
    sequence = 0

    def sse(event_type: str, fields: dict[str, Any]) -> dict[str, str]:
        nonlocal sequence
        data = {"type": event_type, "sequence_number": sequence, **_json(fields)}
        sequence += 1
        return {"event": event_type, "data": json.dumps(data)}

    try:
        async for event_type, fields in run.events():
            yield sse(event_type, fields)
    except Exception as exc:  # an engine error, or a bug of ours: the stream fails
        error = errors.stream_error(exc, gateway.is_draining)
        response = run.response
        response.status = "failed"
        response.error = ResponseError(code=error.code or error.type, message=error.message)
        yield sse("response.failed", {"response": response})


def _json(fields: dict[str, Any]) -> dict[str, Any]:
    return {key: _plain(value) for key, value in fields.items()}


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value
