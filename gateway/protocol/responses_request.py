"""The Responses API request (`POST /v1/responses`) and how it becomes a chat request.

A response is a chat completion in another shape: `input` items become chat messages
(`function_call` items an assistant turn's tool calls, `function_call_output` items tool
messages), `instructions` the system turn, `text.format` the response format, flat function
tools the chat tools. `chat_payload()` writes that chat request, so structured outputs, tool
calling, registry contracts and sampling follow the one chat path.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from engine import MAX_LOGPROBS
from gateway.protocol.common import (
    MAX_TOOLS,
    GenerationBase,
    RequestModel,
    string_as_parts,
    string_or_array,
)
from gateway.protocol.structured import FORMAT_NAME
from gateway.protocol.tools import FUNCTION_NAME, check_choice_among_tools, parse_tool_choice

# The one `include` value that changes what this server returns; the others OpenAI
# documents are accepted (there is nothing of theirs to include here).
INCLUDE_LOGPROBS = "message.output_text.logprobs"
Include = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
]
# OpenAI's bounds on `metadata`: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_LENGTH = 64
MetadataValue = Annotated[str, Field(max_length=512)]


def _unsupported_value(detail: str, **context: Any) -> PydanticCustomError:
    return PydanticCustomError("unsupported_value", detail, context)


class TypedObject(RequestModel):
    """An object whose `type` decides which other fields it needs (an input item, a content
    part, a text format). Checked after validation, field by field (absent: a missing
    parameter; null: an invalid value, both naming the field, e.g. `input[2].call_id`), and
    said in the JSON schema so that generated clients and fuzzers know it too."""

    REQUIRED: ClassVar[dict[str, tuple[str, ...]]] = {}
    DEFAULT_TYPE: ClassVar[str | None] = None  # the type of an object that names none

    model_config = ConfigDict(json_schema_extra=lambda schema, cls: _required_schema(schema, cls))

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> Self:
        kind = getattr(self, "type")  # noqa: B009  (every subclass has one)
        problems: list[InitErrorDetails] = []
        for name in self.REQUIRED.get(kind, ()):
            key = type(self).model_fields[name].alias or name
            if name not in self.model_fields_set:
                problems.append({"type": "missing", "loc": (key,), "input": None})
            elif getattr(self, name) is None:
                null = PydanticCustomError(
                    "invalid_value", "must not be null when 'type' is '{kind}'", {"kind": kind}
                )
                problems.append({"type": null, "loc": (key,), "input": None})
        if problems:
            raise ValidationError.from_exception_data(type(self).__name__, problems)
        return self


def _required_schema(schema: dict[str, Any], cls: Any) -> None:
    not_null = {"not": {"type": "null"}}
    rules = []
    for kind, fields in cls.REQUIRED.items():
        keys = [cls.model_fields[name].alias or name for name in fields]
        condition: dict[str, Any] = {"properties": {"type": {"const": kind}}}
        if kind != cls.DEFAULT_TYPE:
            condition["required"] = ["type"]
        then = {"required": keys, "properties": dict.fromkeys(keys, not_null)}
        rules.append({"if": condition, "then": then})
    schema["allOf"] = rules


# -- input items -------------------------------------------------------------------------------


class InputTextPart(TypedObject):
    """A text part of a message: `input_text` (what users send), `output_text` (an earlier
    answer sent back) or `refusal`; of a reasoning item sent back: `reasoning_text` (its
    content) or `summary_text`. Images, files and audio are refused."""

    REQUIRED: ClassVar[dict[str, tuple[str, ...]]] = {
        "input_text": ("text",),
        "output_text": ("text",),
        "refusal": ("refusal",),
        "reasoning_text": ("text",),
        "summary_text": ("text",),
    }

    type: Literal["input_text", "output_text", "refusal", "reasoning_text", "summary_text"]
    text: str | None = None
    refusal: str | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in cls.REQUIRED:
            raise _unsupported_value(
                "is '{part_type}'; only text parts (input_text, output_text) are supported "
                "by this server",
                part_type=value,
            )
        return value

    @property
    def plain(self) -> str | None:
        return self.refusal if self.type == "refusal" else self.text


TextParts = Annotated[
    list[InputTextPart],
    Field(min_length=1),  # an empty array says nothing: send "" for empty text
    BeforeValidator(
        string_as_parts("input_text"),
        json_schema_input_type=str | Annotated[list[InputTextPart], Field(min_length=1)],
    ),
]


class InputItem(TypedObject):
    """One input item: a message, a function call the model made earlier (sent back so that
    its output can follow), that call's output, or a thinking model's reasoning sent back
    (it joins the assistant turn after it). One model rather than a union tagged by
    `type`, so that errors name `input[2].role`, not a union branch; each type's required
    fields are checked after."""

    REQUIRED: ClassVar[dict[str, tuple[str, ...]]] = {
        "message": ("role", "content"),
        "function_call": ("call_id", "name", "arguments"),
        "function_call_output": ("call_id", "output"),
        "reasoning": ("summary",),
    }
    DEFAULT_TYPE: ClassVar[str | None] = "message"

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: TextParts | None = None
    call_id: str | None = Field(default=None, min_length=1)
    name: str | None = None
    arguments: str | None = None
    output: TextParts | None = None
    summary: list[InputTextPart] | None = None  # a reasoning item's
    encrypted_content: str | None = None  # a reasoning item's; never issued here, ignored
    id: str | None = None
    status: str | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _known_type(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in cls.REQUIRED:
            raise _unsupported_value(
                "is '{item_type}'; this server takes message, function_call, "
                "function_call_output and reasoning items",
                item_type=value,
            )
        return value

    @property
    def text(self) -> str:
        """A message's text, a call output's, or a reasoning item's (its content, else its
        summary)."""
        parts = self.output if self.type == "function_call_output" else self.content
        if self.type == "reasoning" and not parts:
            parts = self.summary
        return "".join(part.plain or "" for part in parts or ())


# A string input is one user message.
_input = string_or_array(
    lambda text: {"type": "message", "role": "user", "content": text}, "input items"
)


# -- tools, text format ------------------------------------------------------------------------


class FunctionTool(RequestModel):
    """The Responses API's function tool: the chat tool's `function` fields, flat."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data: Any) -> Any:
        tool_type = data.get("type") if isinstance(data, dict) else None
        if isinstance(tool_type, str) and tool_type != "function":
            raise _unsupported_value(
                "has type '{tool_type}'; only function tools are supported by this server",
                tool_type=tool_type,
            )
        return data

    def for_chat(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class NamedFunctionChoice(RequestModel):
    type: Literal["function"]
    name: str


def _named_function_choice(value: dict[str, Any]) -> NamedFunctionChoice:
    if value.get("type") != "function" or not isinstance(value.get("name"), str):
        raise _unsupported_value(
            "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}"
        )
    return NamedFunctionChoice.model_validate(value)


def _tool_choice(value: Any) -> Any:
    return parse_tool_choice(value, _named_function_choice)


ResponsesToolChoice = Annotated[
    Any,
    BeforeValidator(
        _tool_choice,
        json_schema_input_type=Literal["none", "auto", "required"] | NamedFunctionChoice,
    ),
]


class TextFormat(TypedObject):
    """`text.format`: the chat `response_format` with the json_schema fields flat."""

    REQUIRED: ClassVar[dict[str, tuple[str, ...]]] = {"json_schema": ("name", "schema_")}

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=FORMAT_NAME)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def for_chat(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        fields: dict[str, Any] = {"name": self.name, "schema": self.schema_}
        fields |= {"description": self.description, "strict": self.strict}
        return {"type": "json_schema", "json_schema": fields}


class TextConfig(RequestModel):
    format: TextFormat | None = None


# -- the request -------------------------------------------------------------------------------


class ResponsesRequest(GenerationBase):
    input: Annotated[
        list[InputItem],
        Field(min_length=1),
        BeforeValidator(
            _input, json_schema_input_type=str | Annotated[list[InputItem], Field(min_length=1)]
        ),
    ]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    include: list[Include] | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ResponsesToolChoice = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, MetadataValue] | None = Field(default=None, max_length=MAX_METADATA_KEYS)
    truncation: Literal["disabled"] | None = Field(
        default=None, description="'auto' (dropping early turns) is not supported"
    )
    background: bool | None = Field(default=None, json_schema_extra={"enum": [False, None]})
    conversation: Any = Field(default=None, json_schema_extra={"type": "null"})

    @field_validator("stream", "store", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("max_output_tokens", "top_logprobs", mode="before")
    @classmethod
    def _integral(cls, value: Any) -> Any:
        return int(value) if type(value) is float and value.is_integer() else value

    @field_validator("truncation", mode="before")
    @classmethod
    def _no_auto_truncation(cls, value: Any) -> Any:
        if value == "auto":
            raise _unsupported_value(
                "is 'auto'; this server does not drop turns to fit the context (send "
                "'disabled' and keep the conversation within the model's context)"
            )
        return value

    @field_validator("metadata")
    @classmethod
    def _short_keys(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key in value or ():
            if len(key) > MAX_METADATA_KEY_LENGTH:
                raise PydanticCustomError(
                    "invalid_value",
                    "keys must be at most {limit} characters; one has {length}",
                    {"limit": MAX_METADATA_KEY_LENGTH, "length": len(key)},
                )
        return value

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool | None) -> bool | None:
        if value:
            raise _unsupported_value("is true; background responses are not supported")
        return value

    @field_validator("conversation")
    @classmethod
    def _no_conversations(cls, value: Any) -> Any:
        if value is not None:
            raise PydanticCustomError(
                "unsupported_parameter",
                "is not supported by this server (chain turns with 'previous_response_id')",
            )
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, value: Any, info: ValidationInfo) -> Any:
        named = value.name if isinstance(value, NamedFunctionChoice) else None
        check_choice_among_tools(value, named, [tool.name for tool in info.data.get("tools") or []])
        return value

    @property
    def wants_logprobs(self) -> bool:
        return INCLUDE_LOGPROBS in (self.include or ()) or self.top_logprobs is not None

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    # -- the chat request it becomes -----------------------------------------------------------
    def input_messages(self) -> list[dict[str, Any]]:
        """The input items as chat messages: calls join the assistant turn before them."""
        messages: list[dict[str, Any]] = []
        reasoning: str | None = None  # a reasoning item's, for the assistant turn after it
        for item in self.input:
            if item.type == "reasoning":
                reasoning = item.text
                continue
            if item.type == "message":
                messages.append({"role": item.role, "content": item.text})
            elif item.type == "function_call_output":
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.text}
                )
            else:
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if last is None or last["role"] != "assistant":
                    last = {"role": "assistant", "content": None}
                    messages.append(last)
                last.setdefault("tool_calls", []).append(call)
            if messages[-1]["role"] == "assistant" and reasoning is not None:
                messages[-1]["reasoning_content"] = reasoning
            reasoning = None
        return messages

    def chat_payload(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat completion request this response is: `history` (the chained previous
        responses' conversation) then this input; `instructions` lead, as the system turn
        (a previous response's instructions are not carried over, as OpenAI does)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": system + history + self.input_messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "user": self.user,
        }
        if self.wants_logprobs:
            payload |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        if self.text is not None and self.text.format is not None:
            payload["response_format"] = self.text.format.for_chat()
        if self.tools:
            payload["tools"] = [tool.for_chat() for tool in self.tools]
            payload["parallel_tool_calls"] = self.parallel_tool_calls
            choice = self.tool_choice
            if isinstance(choice, NamedFunctionChoice):
                choice = {"type": "function", "function": {"name": choice.name}}
            payload["tool_choice"] = choice
        return {key: value for key, value in payload.items() if value is not None}
