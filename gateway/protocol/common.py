"""Constants and helpers shared by the request and response models."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

logger = logging.getLogger(__name__)

MAX_N = 16
MAX_TOOLS = 128
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default length for /v1/completions
MIN_LOGPROB = -9999.0  # what OpenAI reports for -inf; JSON has no infinity

FinishReason = Literal["stop", "length", "tool_calls"]


class RequestModel(BaseModel):
    """Strict JSON types; unknown fields are allowed, logged at DEBUG and otherwise ignored."""

    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="after")
    def _log_unknown_fields(self) -> RequestModel:
        if self.model_extra:
            logger.debug(
                "ignoring unknown fields of %s: %s", type(self).__name__, sorted(self.model_extra)
            )
        return self


class GenerationBase(RequestModel):
    """What admission reads of any request that runs the model: the model it names and the
    engine sequences it will queue."""

    model: str
    user: str | None = None
    prompt_cache_key: str | None = Field(
        default=None,
        description="requests that share it run on the replica that served the last of them "
        "(Ray Serve), where their cached blocks are; one engine: no effect",
    )

    @property
    def affinity_key(self) -> str | None:
        """What keeps a client's requests on one replica: `prompt_cache_key`, else `user`."""
        return self.prompt_cache_key or self.user

    @property
    def num_prompts(self) -> int:
        return 1

    @property
    def num_sequences(self) -> int:
        return 1


def string_as_parts(text_type: str) -> Callable[[Any], Any]:
    """A before-validator for message content: a string becomes one text part of type
    `text_type`, a list passes on to be validated as parts, anything else is refused naming
    the field (not a union branch)."""
    return string_or_array(lambda text: {"type": text_type, "text": text}, "content parts")


def string_or_array(wrap: Callable[[str], Any], items: str) -> Callable[[Any], Any]:
    """A before-validator for a field that takes a string or an array of `items`: a string
    becomes the one-element array `[wrap(string)]`, a list passes on, anything else is
    refused naming the field."""

    def as_array(value: Any) -> Any:
        if isinstance(value, str):
            return [wrap(value)]
        if not isinstance(value, list):
            raise PydanticCustomError(
                "invalid_type",
                f"expected a string or an array of {items}, but got {{got}} instead",
                {"got": json_type_name(value)},
            )
        return value

    return as_array


def random_id(prefix: str) -> str:
    """`random_id("chatcmpl")` -> "chatcmpl-" + 24 hex chars, like OpenAI's ids."""
    return f"{prefix}-{secrets.token_hex(12)}"


def api_finish_reason(reason: str | None) -> FinishReason | None:
    """Map the engine's "stop" | "length" | "abort" | None onto what OpenAI clients accept.

    The engine aborts a request when its client went away or the gateway cancelled it, so an
    "abort" should never reach a reader; if one does, it ends the choice as "stop" (OpenAI's
    types have no "abort") and is logged.
    """
    if reason is None:
        return None
    if reason == "length":
        return "length"
    if reason == "abort":
        logger.warning("an aborted request reached a client; reporting finish_reason 'stop'")
    else:
        assert reason == "stop", reason
    return "stop"


def json_type_name(value: object) -> str:
    """How OpenAI names a JSON value's type in error messages: "a string", "an array", ..."""
    if value is None:
        return "null"
    for kind, name in _JSON_TYPE_NAMES:
        if isinstance(value, kind):
            return name
    return type(value).__name__


_JSON_TYPE_NAMES: tuple[tuple[type, str], ...] = (
    (bool, "a boolean"),
    (int, "an integer"),
    (float, "a decimal"),
    (str, "a string"),
    (list, "an array"),
    (dict, "an object"),
)
