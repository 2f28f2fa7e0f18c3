"""OpenAI request bodies: strict JSON types, unknown fields logged and ignored, features this
server lacks rejected with a clear error."""

from __future__ import annotations

import functools
import logging
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from engine import (
    HERMES,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    CallReader,
    GrammarSpec,
    PrefixContract,
    SamplingParams,
    ToolFormat,
)
from gateway.protocol.common import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    MAX_N,
    MAX_TOOLS,
    GenerationBase,
    RequestModel,
    json_type_name,
    string_as_parts,
)
from gateway.protocol.structured import (
    JsonSchemaValue,
    ResponseFormat,
    StructuredOutputs,
    guided_specs,
)
from gateway.protocol.tools import (
    ChatCompletionTool,
    NamedToolChoice,
    ToolCall,
    ToolChoice,
    check_choice_among_tools,
)

logger = logging.getLogger(__name__)


def _integral(value: Any) -> Any:
    # JSON Schema's "integer" includes numbers with a zero fraction (1.0): accept them as the
    # int they are, so that every schema-valid request validates. 1.5 still fails as a decimal.
    if type(value) is float and value.is_integer():
        return int(value)
    return value


# Integer fields of the generation requests (both routes), for `_integral`.
_INTEGER_FIELDS = (
    "top_k",
    "seed",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "top_logprobs",
    "logprobs",
    "best_of",
)
TokenId = Annotated[int, Field(ge=0)]
T = TypeVar("T")
NonEmpty = Annotated[T, Field(min_length=1)]

# JSON schema of a feature accepted only in its empty form (an empty array or null).
_NONE_YET: dict[str, Any] = {"maxItems": 0}


def _unsupported() -> PydanticCustomError:
    return PydanticCustomError("unsupported_parameter", "is not supported by this server")


# -- requests -------------------------------------------------------------------------------


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _only_text(cls, data: Any) -> Any:
        part_type = data.get("type", "text") if isinstance(data, dict) else "text"
        if part_type != "text":
            raise PydanticCustomError(
                "unsupported_value",
                "has type '{part_type}'; {part_type} content parts are not supported by this "
                "server (send 'text' parts only)",
                {"part_type": str(part_type)},
            )
        return data


# Content is a string or a list of parts; both are stored as parts so that validation errors
# carry their index ("messages[0].content[1]") instead of a union branch name.
MessageContent = Annotated[
    list[TextContentPart],
    Field(min_length=1),  # an empty array says nothing: send "" for empty text
    BeforeValidator(
        string_as_parts("text"),
        json_schema_input_type=str | Annotated[list[TextContentPart], Field(min_length=1)],
    ),
]


def _content_nullable_for_assistants_only(schema: dict[str, Any]) -> None:
    # What the validators below enforce, said in the schema: clients generated from the
    # OpenAPI document must not believe a null user message, a tool result without the call
    # it answers, or a user message with tool calls or reasoning is valid.
    def role_is(*roles: str) -> dict[str, Any]:
        return {"properties": {"role": {"enum": list(roles)}}, "required": ["role"]}

    not_null = {"not": {"type": "null"}}
    schema["allOf"] = [
        {
            "if": role_is("system", "developer", "user", "tool"),
            "then": {"required": ["content"], "properties": {"content": not_null}},
        },
        {
            "if": role_is("tool"),
            "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": not_null}},
            "else": {"properties": {"tool_call_id": {"type": "null"}}},
        },
        {
            "if": role_is("assistant"),
            "else": {
                "properties": {
                    "tool_calls": {"anyOf": [{"type": "null"}, {"maxItems": 0}]},
                    "reasoning_content": {"type": "null"},
                    "reasoning": {"type": "null"},
                }
            },
        },
    ]


class ChatMessage(RequestModel):
    """One input message. "developer" is treated as "system"; `content` may be null only for
    "assistant" messages (it then counts as empty text); an assistant turn may carry the
    `tool_calls` it made and the reasoning a thinking model returned with it
    (`reasoning_content`, or `reasoning` as newer vLLM names it; the template decides whether
    to write it), and a "tool" message answers one of them (`tool_call_id`)."""

    model_config = ConfigDict(json_schema_extra=_content_nullable_for_assistants_only)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: MessageContent | None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _assistant_content_may_be_absent(cls, data: Any) -> Any:
        # An assistant turn that only called tools often comes without `content` (the SDK's
        # model_dump(exclude_none=True) drops it); every other role must send it.
        if isinstance(data, dict) and data.get("role") == "assistant" and "content" not in data:
            return {**data, "content": None}
        return data

    @field_validator("role", mode="before")
    @classmethod
    def _no_function_role(cls, value: Any) -> Any:
        if value == "function":
            raise PydanticCustomError(
                "unsupported_value",
                "is 'function'; the deprecated function messages are not supported by this "
                "server (send 'tool' messages)",
            )
        return value

    @field_validator("content")
    @classmethod
    def _content_required(
        cls, value: list[TextContentPart] | None, info: ValidationInfo
    ) -> list[TextContentPart] | None:
        role = info.data.get("role")
        if value is None and role not in (None, "assistant"):
            raise PydanticCustomError(
                "invalid_value", "must not be null for role '{role}'", {"role": role}
            )
        return value

    @field_validator("tool_calls")
    @classmethod
    def _calls_from_the_assistant(
        cls, value: list[ToolCall] | None, info: ValidationInfo
    ) -> list[ToolCall] | None:
        if value and info.data.get("role") != "assistant":
            raise PydanticCustomError("invalid_value", "only assistant messages make tool calls")
        return value

    @field_validator("reasoning_content", "reasoning")
    @classmethod
    def _reasoning_of_the_assistant(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("role") != "assistant":
            raise PydanticCustomError("invalid_value", "only assistant messages carry reasoning")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _id_for_tool_results(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("role") != "tool":
            raise PydanticCustomError("invalid_value", "only tool messages answer a tool call")
        return value

    @model_validator(mode="after")
    def _tool_result_names_its_call(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError(
                "invalid_value", "a tool message needs the 'tool_call_id' it answers"
            )
        return self

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or ())

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (HF's tool-calling convention)."""
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text,
        }
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message


def _stop_as_list(value: Any) -> Any:
    if isinstance(value, str):
        return [value]
    if value is not None and not isinstance(value, list):
        raise PydanticCustomError(
            "invalid_type",
            "expected a string or an array of strings, but got {got} instead",
            {"got": json_type_name(value)},
        )
    return value


StopString = Annotated[str, Field(min_length=1)]
StopStrings = Annotated[
    list[StopString],
    Field(max_length=MAX_STOP_STRINGS),
    BeforeValidator(
        _stop_as_list,
        json_schema_input_type=StopString
        | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
        | None,
    ),
]


TOKEN_ID_KEY = "^(0|[1-9][0-9]*)$"  # a logit_bias key: a token id, one spelling per id


class StreamOptions(RequestModel):
    include_usage: bool | None = None


class GenerationRequest(GenerationBase):
    """Fields shared by chat and completions. Declaration order matters: a validator reads
    the fields declared before it from `info.data` (`stream` before `stream_options`, `n`
    before `best_of`)."""

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, description="extension; -1 or 0: disabled")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, description="extension")
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: StopStrings | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0, description="extension")
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = (
        Field(
            default=None,
            description="token id (a decimal string) -> a number in [-100, 100] added to its "
            "logit at every step",
            json_schema_extra={"propertyNames": {"pattern": TOKEN_ID_KEY}},
        )
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(
        default=None,
        description="extension (vLLM's): cached work is shared only between requests with "
        "the same salt",
    )
    ignore_eos: bool = Field(default=False, description="extension")
    skip_special_tokens: bool = Field(default=True, description="extension")
    speculative: bool = Field(
        default=True,
        description="extension: false keeps this request off speculative decoding (drafted "
        "tokens verified in one forward); its tokens are the same either way",
    )
    # vLLM's structured-output extensions (gateway/protocol/structured.py): one at a time.
    guided_json: JsonSchemaValue | None = Field(default=None, description="extension")
    guided_regex: str | None = Field(default=None, description="extension")
    guided_choice: list[str] | None = Field(default=None, min_length=1, description="extension")
    guided_grammar: str | None = Field(default=None, description="extension")
    structured_outputs: StructuredOutputs | None = Field(default=None, description="extension")

    @field_validator(*_INTEGER_FIELDS, mode="before", check_fields=False)
    @classmethod
    def _integral_number(cls, value: Any) -> Any:
        return _integral(value)

    @field_validator(
        "n", "stream", "ignore_eos", "skip_special_tokens", "speculative", mode="before"
    )
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """Keys are token ids as OpenAI writes them ("50256"): one spelling per id, so two
        keys never name one token."""
        for key in value or {}:
            if not re.fullmatch(TOKEN_ID_KEY, key):
                raise PydanticCustomError(
                    "invalid_value", "keys must be token ids written as decimal integers"
                )
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and info.data.get("stream") is False:
            raise PydanticCustomError("invalid_value", "only allowed when 'stream' is true")
        return value

    @model_validator(mode="after")
    def _one_constraint(self) -> GenerationRequest:
        constraints = self.constraints
        if len(constraints) > 1:
            names = " and ".join(name for name, _ in constraints)
            raise PydanticCustomError(
                "invalid_value",
                "one structured output constraint at a time, got {names}",
                {"names": names},
            )
        return self

    @functools.cached_property
    def constraints(self) -> list[tuple[str, GrammarSpec]]:
        """(field, spec) of each structured output constraint the request sets. Built once:
        validation, error naming and the sampling parameters all read it (a tool grammar or
        a schema is serialised to build its spec)."""
        pairs = self._format_constraints() + guided_specs(
            self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar
        )
        if self.structured_outputs is not None:
            pairs += [("structured_outputs", s) for s in self.structured_outputs.specs()]
        return pairs

    def _format_constraints(self) -> list[tuple[str, GrammarSpec]]:
        """Constraints of route-specific fields (chat: response_format, tools)."""
        return []

    @property
    def engine_fields(self) -> dict[str, str]:
        """Engine parameter -> the field of this request it came from (errors name it)."""
        constraints = self.constraints
        grammar = constraints[0][0] if constraints else "response_format"
        return {"prompt": "prompt", "max_tokens": "max_tokens", "grammar": grammar}

    @property
    def num_sequences(self) -> int:
        """Engine sequences this request queues: one per choice per prompt."""
        return self.n * self.num_prompts

    @property
    def num_prompts(self) -> int:
        return 1

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        contract: PrefixContract | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """`contract`: the registry entry the prompt hit; its fields fill what the request
        left unset (its own format, `response_format: text` included, wins)."""
        contract = contract or PrefixContract()
        constraints = self.constraints
        if constraints:
            grammar: GrammarSpec | None = constraints[0][1]
        else:
            grammar = None if self.sets_own_format else contract.grammar
        temperature = self.temperature if self.temperature is not None else contract.temperature
        stop = self.stop if self.stop is not None else contract.stop
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=tuple(stop or ()),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=(
                1.0 if self.repetition_penalty is None else self.repetition_penalty
            ),
            logprobs=logprobs,
            skip_special_tokens=self._skips_special_tokens,
            grammar=grammar,
            prompt_logprobs=prompt_logprobs,
            speculative=self.speculative,
            logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
        )

    @property
    def sets_own_format(self) -> bool:
        """The request states its output format itself (even as plain text)."""
        return bool(self.constraints)

    @property
    def _skips_special_tokens(self) -> bool:
        """Whether the answer's text leaves out special tokens (the request's
        `skip_special_tokens`, or less: ChatCompletionRequest's)."""
        return self.skip_special_tokens


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, description="deprecated by OpenAI")
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's, SGLang's and llama.cpp server's extension: more variables for the chat template
    # (Qwen3's and SmolLM3's `enable_thinking`, Llama 3.1's `date_string`...)
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="variables for the model's chat template (for example "
        '`{"enable_thinking": false}`), besides those the server sets: messages, tools, '
        "documents, add_generation_prompt",
    )
    # Features this server does not have: accepted only in their "off" form.
    # The schema says what is accepted today, so generated clients and fuzzers agree with
    # the validators below (which give the friendlier errors).
    tools: list[ChatCompletionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = Field(default=None, json_schema_extra=_NONE_YET)
    function_call: Any = Field(default=None, json_schema_extra={"enum": ["none", None]})
    response_format: ResponseFormat | None = None
    audio: Any = Field(default=None, json_schema_extra={"type": "null"})
    modalities: list[str] | None = Field(
        default=None, json_schema_extra={"items": {"const": "text"}, "minItems": 1, "maxItems": 1}
    )
    prediction: Any = Field(default=None, json_schema_extra={"type": "null"})
    _tool_format: ToolFormat = PrivateAttr(default=HERMES)

    def model_post_init(self, context: Any, /) -> None:
        """The served model's tool format (the validation context's "tool_format", which the
        gateway sets; Hermes' without one), read before the validators that build the tool
        grammar in it."""
        if isinstance(context, dict) and isinstance(context.get("tool_format"), ToolFormat):
            self._tool_format = context["tool_format"]

    def call_reader(self, opening_in_prompt: bool) -> CallReader | None:
        """How the output is read for calls; None where no tools are in use. Its opening,
        the start the tool grammar forces on every answer, goes in the prompt unless the
        model thinks first (`ToolFormat.reader`)."""
        if not self.uses_tools:
            return None
        return self._tool_format.reader(self._named_function, self._is_required, opening_in_prompt)

    @property
    def _named_function(self) -> str | None:
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else None

    @property
    def _is_required(self) -> bool:
        return self.tool_choice == "required" or self._named_function is not None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _null_logprobs(cls, value: Any) -> Any:
        return False if value is None else value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("logprobs") is False:
            raise PydanticCustomError("invalid_value", "only allowed when 'logprobs' is true")
        return value

    @field_validator("functions")
    @classmethod
    def _unsupported_list(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise _unsupported()
        return value

    @field_validator("audio", "prediction")
    @classmethod
    def _unsupported_feature(cls, value: Any) -> Any:
        if value is not None:
            raise _unsupported()
        return value

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: Any) -> Any:
        if value is not None and value != "none":
            raise PydanticCustomError(
                "unsupported_value",
                "must be 'none': the deprecated function calling is not supported by this "
                "server (send 'tools')",
            )
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, value: Any, info: ValidationInfo) -> Any:
        named = value.function.name if isinstance(value, NamedToolChoice) else None
        names = [tool.function.name for tool in info.data.get("tools") or []]
        check_choice_among_tools(value, named, names)
        return value

    @field_validator("modalities")
    @classmethod
    def _text_modality_only(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and value != ["text"]:
            raise PydanticCustomError(
                "unsupported_value",
                "must be ['text']: other output modalities are not supported by this server",
            )
        return value

    @field_validator("messages")
    @classmethod
    def _tool_results_answer_calls(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        """A tool message answers a call an earlier assistant message made (as OpenAI
        requires): a result for no call would be rendered as if one had been made."""
        called: set[str] = set()
        for index, message in enumerate(messages):
            called.update(call.id for call in message.tool_calls or ())
            if message.role == "tool" and message.tool_call_id not in called:
                unanswered = PydanticCustomError(
                    "invalid_value",
                    "'{call_id}' is not the id of a tool call an earlier assistant message made",
                    {"call_id": message.tool_call_id},
                )
                problem: InitErrorDetails = {
                    "type": unanswered,
                    "loc": (index, "tool_call_id"),
                    "input": message.tool_call_id,
                }
                raise ValidationError.from_exception_data(cls.__name__, [problem])
        return messages

    @property
    def engine_fields(self) -> dict[str, str]:
        length = "max_completion_tokens" if self.max_completion_tokens else "max_tokens"
        return {**super().engine_fields, "prompt": "messages", "max_tokens": length}

    def flat_messages(self) -> list[dict[str, Any]]:
        """Messages as chat templates take them (role, text, tool calls and results)."""
        return [m.for_template() for m in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools or []]

    @property
    def uses_tools(self) -> bool:
        """Tools are offered and the model may call them: its output is read for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def _skips_special_tokens(self) -> bool:
        """Calls whose tag is one of the tokenizer's tokens (Mistral's `[TOOL_CALLS]`, a
        special token) are read from text that keeps special tokens, as vLLM does."""
        if self.uses_tools and self._tool_format.token_tags:
            return False
        return self.skip_special_tokens

    def _format_constraints(self) -> list[tuple[str, GrammarSpec]]:
        """The response format, or with tools one grammar of calls whose non-call answer
        follows the response format (an agent with tools and a structured final output)."""
        spec = self.response_format.spec() if self.response_format is not None else None
        if not self.uses_tools:
            return [("response_format", spec)] if spec is not None else []
        named = self._named_function
        grammar = self._tool_format.grammar(
            self.tool_dicts(),
            named,
            is_required=self._is_required,
            # A named function is called once, as OpenAI does.
            parallel=self.parallel_tool_calls is not False and named is None,
            answer=spec,
        )
        return [("tools", grammar)]

    @property
    def sets_own_format(self) -> bool:
        return self.response_format is not None or super().sets_own_format

    def to_sampling_params(
        self, default_max_tokens: int | None, contract: PrefixContract | None = None
    ) -> SamplingParams:
        """`max_completion_tokens` wins over `max_tokens`, then the hit entry's `max_tokens`,
        then `default_max_tokens`, which also caps the entry's (what the context has left)."""
        entry_max = contract.max_tokens if contract is not None else None
        if entry_max is not None and default_max_tokens is not None:
            entry_max = min(entry_max, default_max_tokens)
        max_tokens = (
            self.max_completion_tokens or self.max_tokens or entry_max or default_max_tokens
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, contract)


def _check_prompt(value: Any) -> Any:
    # Checked here, not by the union below, so that errors name "prompt", not a union branch.
    if isinstance(value, str) or (
        isinstance(value, list) and value and all(isinstance(item, str) for item in value)
    ):
        if value == "" or (isinstance(value, list) and "" in value):
            raise PydanticCustomError("invalid_value", "must not contain an empty prompt")
        return value
    if not isinstance(value, list):
        raise PydanticCustomError(
            "invalid_type",
            "expected a string or an array, but got {got} instead",
            {"got": json_type_name(value)},
        )
    if not value:
        raise PydanticCustomError("invalid_value", "must not be an empty array")
    value = [
        [_integral(i) for i in item] if isinstance(item, list) else _integral(item)
        for item in value
    ]
    batches = value if all(isinstance(item, list) for item in value) else [value]
    if not all(_is_token_ids(ids) for ids in batches):
        raise PydanticCustomError(
            "invalid_value",
            "must be a string, an array of strings, an array of token ids or an array of "
            "non-empty arrays of token ids (token ids are non-negative integers)",
        )
    return value


def _is_token_ids(ids: list[Any]) -> bool:
    return bool(ids) and all(type(token_id) is int and token_id >= 0 for token_id in ids)


class CompletionRequest(GenerationRequest):
    prompt: Annotated[
        NonEmpty[str]
        | NonEmpty[list[NonEmpty[str]]]
        | NonEmpty[list[TokenId]]
        | NonEmpty[list[NonEmpty[list[TokenId]]]],
        BeforeValidator(_check_prompt),
    ]
    echo: bool = False  # before max_tokens, whose validator reads it
    max_tokens: int | None = Field(
        default=COMPLETION_DEFAULT_MAX_TOKENS, ge=0, description="0 only with echo"
    )
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = Field(
        default=None,
        description="needs a model with a fill-in-the-middle format; not with echo",
    )
    best_of: int | None = Field(
        default=None, ge=1, description="must equal n (candidates beyond n are not supported)"
    )

    @field_validator("echo", mode="before")
    @classmethod
    def _null_echo(cls, value: Any) -> Any:
        return False if value is None else value

    @field_validator("max_tokens")
    @classmethod
    def _zero_tokens_need_echo(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value == 0 and not info.data.get("echo"):
            raise PydanticCustomError(
                "invalid_value", "may be 0 only with 'echo': true (to score the prompt alone)"
            )
        return value

    @field_validator("suffix")
    @classmethod
    def _suffix_not_echoed(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("echo"):
            raise PydanticCustomError(
                "unsupported_value",
                "cannot be combined with 'echo': true (the prompt is sent wrapped in the "
                "model's fill-in-the-middle tokens around the suffix, which the echoed text "
                "would not show)",
            )
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n")
        if value is not None and n is not None and value != n:
            raise PydanticCustomError(
                "unsupported_value",
                "must equal 'n' ({n}): a best_of other than n is not supported by this server",
                {"n": n},
            )
        return value

    @property
    def num_prompts(self) -> int:
        return len(self.prompts())

    def prompts(self) -> list[str] | list[list[int]]:
        """One entry per prompt: strings, or token id lists."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [prompt]
        return prompt

    def to_sampling_params(self, contract: PrefixContract | None = None) -> SamplingParams:
        """`max_tokens` absent or null: the hit entry's, else OpenAI's default (16)."""
        entry_max = contract.max_tokens if contract is not None else None
        own_max = self.max_tokens if "max_tokens" in self.model_fields_set else None
        if own_max is None:
            own_max = entry_max or COMPLETION_DEFAULT_MAX_TOKENS
        # An echoed prompt comes with its logprobs when logprobs are asked for; max_tokens 0
        # (echo only) is a scoring request for the engine either way.
        prompt_logprobs = self.logprobs if self.echo else None
        if own_max == 0 and prompt_logprobs is None:
            prompt_logprobs = 0
        return self._sampling_params(own_max, self.logprobs, contract, prompt_logprobs)
