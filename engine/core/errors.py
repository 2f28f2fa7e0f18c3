"""Typed engine errors. The gateway maps each class, in one place, to an HTTP status."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError):
    """The caller sent something the engine cannot serve; `param` names the offending input in
    the engine's terms ("prompt" for the prompt's token ids); the gateway renames it to the
    API field the prompt came from."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code  # OpenAI-style error code, when one names the problem better


class PromptTooLongError(InvalidRequestError):
    """Prompt plus requested output does not fit in `max_model_len` (or in the whole KV pool).
    `param` is "prompt" when the prompt alone is too long, "max_tokens" when the prompt fits
    and the requested completion length is what does not."""

    def __init__(
        self, message: str, num_prompt_tokens: int, max_model_len: int, param: str = "prompt"
    ) -> None:
        super().__init__(message, param=param)
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


class ModelLoadError(EngineError):
    """The model spec cannot be loaded: missing path, unsupported architecture, bad files."""


class EngineDeadError(EngineError):
    """The engine loop has stopped; no request can be served any more."""


class RequestFailedError(EngineError):
    """A request failed inside the engine loop (for example its forward raised)."""


class EngineUnavailableError(EngineError):
    """The engine that took this request went away, or none took it in time (a replica of
    several failed or is restarting); the request may succeed if sent again."""
