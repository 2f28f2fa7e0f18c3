"""prefixgate's inference engine: paged KV cache, continuous batching, prefix registry.

This module is the engine's public API; the gateway imports only from here.
"""

from engine.async_engine import AsyncEngine
from engine.core.config import EngineConfig, default_cache_dir, option
from engine.core.errors import (
    EngineDeadError,
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    RequestFailedError,
)
from engine.core.outputs import RequestOutput, SampleLogprobs, TokenLogprob
from engine.core.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    GrammarSpec,
    SamplingParams,
    ThinkFirst,
)
from engine.kvcache.block_hash import BlockHash, extend_block_hashes, scope_seed
from engine.llm_engine import LLMEngine
from engine.registry.file import load_prefix_file
from engine.registry.index import PrefixIndex
from engine.registry.loader import PrefixBudgetError
from engine.registry.registry import (
    MatchReport,
    PrefixRegistry,
    RegisteredPrefix,
    ReloadStatus,
    registry_digest,
)
from engine.registry.spec import PrefixContract, PrefixSpec, RegistryFileError
from engine.request import EngineRequest
from engine.request_checker import RequestChecker, RequestLimits
from engine.scheduler.pacing import HistogramCounts
from engine.speculative.drafter import DraftCounts
from engine.stats import EngineStats, PrefixInfo
from engine.text.chat import answer_start_ids, chat_prompt_ids, fim_prompt_ids, text_prompt_ids
from engine.text.reasoning import (
    PromptEnd,
    ReasoningFormat,
    ReasoningSplitter,
    reasoning_format_of,
    split_reasoning,
)
from engine.text.tool_format import (
    GRANITE,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    MISTRAL_ARGS,
    PHI4_MINI,
    CallReader,
    ParsedToolCall,
    ToolFormat,
    tool_format_of,
)

__all__ = [
    "GRANITE",
    "HERMES",
    "LLAMA3_JSON",
    "MAX_LOGIT_BIAS",
    "MAX_LOGPROBS",
    "MAX_STOP_STRINGS",
    "MISTRAL",
    "MISTRAL_ARGS",
    "PHI4_MINI",
    "AsyncEngine",
    "BlockHash",
    "CallReader",
    "DraftCounts",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "EngineRequest",
    "EngineStats",
    "EngineUnavailableError",
    "GrammarSpec",
    "HistogramCounts",
    "InvalidRequestError",
    "LLMEngine",
    "MatchReport",
    "ModelLoadError",
    "ParsedToolCall",
    "PrefixBudgetError",
    "PrefixContract",
    "PrefixIndex",
    "PrefixInfo",
    "PrefixRegistry",
    "PrefixSpec",
    "PromptEnd",
    "PromptTooLongError",
    "ReasoningFormat",
    "ReasoningSplitter",
    "RegisteredPrefix",
    "RegistryFileError",
    "ReloadStatus",
    "RequestChecker",
    "RequestFailedError",
    "RequestLimits",
    "RequestOutput",
    "SampleLogprobs",
    "SamplingParams",
    "ThinkFirst",
    "TokenLogprob",
    "ToolFormat",
    "answer_start_ids",
    "chat_prompt_ids",
    "default_cache_dir",
    "extend_block_hashes",
    "fim_prompt_ids",
    "load_prefix_file",
    "option",
    "reasoning_format_of",
    "registry_digest",
    "scope_seed",
    "split_reasoning",
    "text_prompt_ids",
    "tool_format_of",
]
