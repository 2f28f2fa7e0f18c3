"""What the Responses API returns: the response object, its output items and usage, and the
typed stream events, in the shapes the official SDK parses."""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from gateway.protocol.responses import Logprob

ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


def response_id(prefix: str) -> str:
    """OpenAI's Responses ids: "resp_...", "msg_...", "fc_...", "call_..."."""
    return f"{prefix}_{secrets.token_hex(16)}"


class OutputTopLogprob(BaseModel):
    token: str
    logprob: Logprob
    bytes: list[int]


class OutputLogprob(OutputTopLogprob):
    top_logprobs: list[OutputTopLogprob] = Field(default_factory=list)


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[OutputLogprob] | None = None


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: response_id("msg"))
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallOutput(BaseModel):
    """A call the model made (an output item; the client runs it and sends its result back
    as a `function_call_output` input item with the same `call_id`)."""

    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: response_id("fc"))
    call_id: str = Field(default_factory=lambda: response_id("call"))
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(BaseModel):
    """A thinking model's reasoning (engine/text/reasoning.py), before its answer: the text
    as it wrote it, no summary and nothing encrypted (as vLLM returns an open model's)."""

    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: response_id("rs"))
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = ReasoningOutput | OutputMessage | FunctionCallOutput


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # prompt tokens this response put in the prefix cache


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def from_counts(
        cls, num_input: int, num_output: int, num_cached: int, num_written: int = 0
    ) -> ResponseUsage:
        return cls(
            input_tokens=num_input,
            input_tokens_details=InputTokensDetails(
                cached_tokens=num_cached, cache_write_tokens=num_written
            ),
            output_tokens=num_output,
            total_tokens=num_input + num_output,
        )


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """The response; the request's settings are echoed as OpenAI does (`tools` and
    `tool_choice` in the Responses shape, `text.format` as sent)."""

    id: str = Field(default_factory=lambda: response_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: ResponseStatus = "in_progress"
    completed_at: int | None = None  # set when the status is "completed"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    instructions: str | None = None
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    store: bool = True
    background: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})

    @property
    def output_text(self) -> str:
        return "".join(
            part.text
            for item in self.output
            if isinstance(item, OutputMessage)
            for part in item.content
        )


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
