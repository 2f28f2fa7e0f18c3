"""prefixgate's inference engine: paged KV cache, continuous batching, prefix registry.

This module is the engine's public API; the gateway imports only from here.
"""

from engine.async_engine import AsyncEngine
from engine.chat import chat_prompt_ids, fim_prompt_ids, text_prompt_ids
from engine.config import EngineConfig, option
from engine.errors import (
    EngineDeadError,
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    RequestFailedError,
)
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, SampleLogprobs, TokenLogprob
from engine.prefix_loader import PrefixBudgetError
from engine.registry import MatchReport, PrefixRegistry, RegisteredPrefix, ReloadStatus
from engine.registry_file import PrefixContract, PrefixSpec, RegistryFileError, load_prefix_file
from engine.request import EngineRequest
from engine.request_checker import RequestChecker, RequestLimits
from engine.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, GrammarSpec, SamplingParams
from engine.stats import EngineStats, PrefixInfo
from engine.tool_format import ParsedToolCall, parse_tool_calls, tool_call_grammar

__all__ = [
    "MAX_LOGPROBS",
    "MAX_STOP_STRINGS",
    "AsyncEngine",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "EngineRequest",
    "EngineStats",
    "EngineUnavailableError",
    "GrammarSpec",
    "InvalidRequestError",
    "LLMEngine",
    "MatchReport",
    "ModelLoadError",
    "ParsedToolCall",
    "PrefixBudgetError",
    "PrefixContract",
    "PrefixInfo",
    "PrefixRegistry",
    "PrefixSpec",
    "PromptTooLongError",
    "RegisteredPrefix",
    "RegistryFileError",
    "ReloadStatus",
    "RequestChecker",
    "RequestFailedError",
    "RequestLimits",
    "RequestOutput",
    "SampleLogprobs",
    "SamplingParams",
    "TokenLogprob",
    "chat_prompt_ids",
    "fim_prompt_ids",
    "load_prefix_file",
    "option",
    "parse_tool_calls",
    "text_prompt_ids",
    "tool_call_grammar",
]
