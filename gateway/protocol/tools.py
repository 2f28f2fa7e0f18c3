"""Tool calling in requests and responses: function tools, `tool_choice`, the calls an
assistant turn made and the tool results that answer them (OpenAI's shapes)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, ValidationError
from pydantic_core import PydanticCustomError

from gateway.protocol.common import RequestModel, json_type_name

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatCompletionTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


ToolMode = Literal["none", "auto", "required"]


def _tool_choice(value: Any) -> Any:
    """Validated here rather than as a union, so that errors name `tool_choice` and not a
    union branch."""
    if value is None:
        return None
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise PydanticCustomError(
                "invalid_value", "input should be 'none', 'auto' or 'required'"
            )
        return value
    if isinstance(value, dict):
        try:
            return NamedToolChoice.model_validate(value)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise PydanticCustomError(
                "invalid_value", "{where}: {problem}", {"where": where, "problem": first["msg"]}
            ) from None
    raise PydanticCustomError(
        "invalid_type",
        "expected a string or an object, but got {got} instead",
        {"got": json_type_name(value)},
    )


ToolChoice = Annotated[
    Any, BeforeValidator(_tool_choice, json_schema_input_type=ToolMode | NamedToolChoice)
]


class FunctionCall(RequestModel):
    name: str
    arguments: str  # JSON text


class ToolCall(RequestModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(BaseModel):
    """A streamed call: this server sends each call whole, in one delta."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut
