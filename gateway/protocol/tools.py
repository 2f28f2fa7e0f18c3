"""Tool calling in requests and responses: function tools, `tool_choice`, the calls an
assistant turn made and the tool results that answer them (OpenAI's shapes)."""

from __future__ import annotations

from collections.abc import Callable
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


def parse_tool_choice(value: Any, named: Callable[[dict[str, Any]], Any]) -> Any:
    """A mode or, given as an object, `named(value)`: validated here rather than as a
    union, so that errors name `tool_choice` and not a union branch (chat and Responses
    differ only in the shape of a named choice)."""
    if value is None or isinstance(value, BaseModel):
        return value
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise PydanticCustomError(
                "invalid_value", "input should be 'none', 'auto' or 'required'"
            )
        return value
    if isinstance(value, dict):
        return named(value)
    raise PydanticCustomError(
        "invalid_type",
        "expected a string or an object, but got {got} instead",
        {"got": json_type_name(value)},
    )


def check_choice_among_tools(value: Any, named: str | None, tool_names: list[str]) -> None:
    """`required` and a named function (`named`) need tools, and a named one must be among
    them: a cross-field rule of both request shapes, named on `tool_choice`."""
    if (value == "required" or named is not None) and not tool_names:
        raise PydanticCustomError("invalid_value", "needs 'tools' to choose from")
    if named is not None and named not in tool_names:
        raise PydanticCustomError(
            "invalid_value", "names '{name}', which is not among 'tools'", {"name": named}
        )


def _named_chat_choice(value: dict[str, Any]) -> NamedToolChoice:
    try:
        return NamedToolChoice.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise PydanticCustomError(
            "invalid_value", "{where}: {problem}", {"where": where, "problem": first["msg"]}
        ) from None


def _tool_choice(value: Any) -> Any:
    return parse_tool_choice(value, _named_chat_choice)


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
