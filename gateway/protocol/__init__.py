"""The OpenAI wire protocol as pydantic v2 models: requests validated, responses serialised.

Requests are strict (JSON types only: "0.5" is not a number, `true` is not an integer), accept
unknown fields (logged at DEBUG and ignored: clients send `store`, `metadata`,
`service_tier`, ...) and reject features this server lacks with a clear error instead of ignoring
them. Validators raise `PydanticCustomError` whose type is the OpenAI error code
("invalid_value", "unsupported_parameter", "unsupported_value"); `gateway.errors` turns the
first error into the OpenAI error body, with `param` taken from the error's location.

Responses are serialised with a plain `model_dump(mode="json")` / `model_dump_json()`: nulls are
kept as OpenAI sends them (`"logprobs": null`, `"finish_reason": null` in chunks, `"param": null`
in errors); only `DeltaMessage` drops its unset fields, so `role` appears in the first chunk only.
"""

from gateway.protocol.common import (
    MAX_N,
    MIN_LOGPROB,
    FinishReason,
    GenerationBase,
    api_finish_reason,
    json_type_name,
    random_id,
)
from gateway.protocol.requests import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerationRequest,
    StreamOptions,
    TextContentPart,
)
from gateway.protocol.responses import (
    ChatCompletionLogprobs,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatCompletionTokenLogprob,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)

__all__ = [
    "MAX_N",
    "MIN_LOGPROB",
    "ChatCompletionLogprobs",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionResponseChoice",
    "ChatCompletionStreamChoice",
    "ChatCompletionStreamResponse",
    "ChatCompletionTokenLogprob",
    "ChatMessage",
    "ChatMessageOut",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionStreamChoice",
    "CompletionStreamResponse",
    "DeltaMessage",
    "ErrorInfo",
    "ErrorResponse",
    "FinishReason",
    "GenerationBase",
    "GenerationRequest",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "StreamOptions",
    "TextContentPart",
    "TopLogprob",
    "UsageInfo",
    "api_finish_reason",
    "json_type_name",
    "random_id",
]
