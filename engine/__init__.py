"""prefixgate's inference engine: paged KV cache, continuous batching, prefix registry.

This module is the engine's public API; the gateway imports only from here.
"""

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import (
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    RequestFailedError,
)
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, SampleLogprobs, TokenLogprob
from engine.sampling_params import SamplingParams

__all__ = [
    "AsyncEngine",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "InvalidRequestError",
    "LLMEngine",
    "ModelLoadError",
    "PromptTooLongError",
    "RequestFailedError",
    "RequestOutput",
    "SampleLogprobs",
    "SamplingParams",
    "TokenLogprob",
]
