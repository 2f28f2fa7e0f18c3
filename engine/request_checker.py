"""RequestChecker: the one validation of a request, wherever it runs.

The engine validates each request before it admits it; a gateway in front of engine replicas
on other machines (Ray Serve) validates the same way before a response starts, so that a bad
request gets its 400 from the ingress instead of after a hop. Both use this class: the
checks read only the model's facts (vocabulary, context length) and the KV pool's capacity,
which `limits` reports as it is now (a reload pins more or fewer blocks).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.core.errors import InvalidRequestError, PromptTooLongError
from engine.core.sampling_params import GRAMMAR_PARAM, GrammarSpec, SamplingParams
from engine.kvcache.block_pool import num_blocks_for
from engine.request import EngineRequest
from engine.structured.grammar import CompiledGrammar, GrammarCompiler, check_grammar


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What a request must fit in: the model's vocabulary and context, and the KV blocks a
    request may hold (the pool less the blocks pinned by registered prefixes)."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_usable_blocks: int


class RequestChecker:
    """Typed errors for anything the engine cannot serve, else an `EngineRequest` it trusts.
    Thread-safe: the gateway's workers call it while the engine thread steps."""

    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        limits: Callable[[], RequestLimits],
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.limits = limits
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    @property
    def grammars(self) -> GrammarCompiler:
        """Built on first use: wrapping the tokenizer for llguidance takes ~0.4 s (SmolLM2),
        which a server that never sees a constrained request need not pay."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(
                    self.tokenizer, self.limits().vocab_size, self.eos_token_ids
                )
            return self._grammars

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile `spec` (cached), or raise InvalidRequestError naming "grammar"."""
        return self.grammars.compile(spec)

    def check(self, spec: GrammarSpec) -> None:
        """Raise InvalidRequestError naming "grammar" where `spec` is wrong: compiled when the
        compiler exists (a constrained request built it), else checked without the tokenizer,
        so that a registry's contracts do not put the compiler's ~0.35 s on a start before
        /health 200; the first request that uses a contract compiles it."""
        with self._grammars_lock:
            compiler = self._grammars
        if compiler is not None:
            compiler.compile(spec)
        else:
            check_grammar(spec)

    def prepare(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        tenant: str | None = None,
    ) -> EngineRequest:
        check_request(self.limits(), prompt_token_ids, params)
        grammar = self.compile(params.grammar) if params.grammar is not None else None
        if grammar is not None and params.num_grammar_prompt_tokens:
            grammar = _started(grammar, prompt_token_ids, params.num_grammar_prompt_tokens)
        return EngineRequest(list(prompt_token_ids), params, cache_salt, grammar, tenant)


def _started(grammar: CompiledGrammar, prompt_token_ids: list[int], num: int) -> CompiledGrammar:
    """The prompt's last `num` tokens are where the grammar's text starts: it must allow
    them, and every sequence of the request starts from the grammar having read them."""
    if num >= len(prompt_token_ids):
        raise InvalidRequestError(
            "the grammar's start must leave a prompt before it", param=GRAMMAR_PARAM
        )
    try:
        return grammar.started(prompt_token_ids[-num:])
    except ValueError as exc:
        raise InvalidRequestError(
            f"the grammar does not allow the prompt's last {num} tokens: {exc}",
            param=GRAMMAR_PARAM,
        ) from exc


def check_request(
    limits: RequestLimits, prompt_token_ids: list[int], params: SamplingParams
) -> None:
    """Raise InvalidRequestError / PromptTooLongError when the prompt and `max_tokens` do not
    fit `limits`."""
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt must contain at least one token", param="prompt")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= limits.vocab_size:
        raise InvalidRequestError(
            f"token ids must be in [0, {limits.vocab_size})",
            param="prompt",
            code="invalid_token_id",
        )
    if any(token_id >= limits.vocab_size for token_id, _ in params.logit_bias):
        raise InvalidRequestError(
            f"logit_bias keys must be token ids in [0, {limits.vocab_size})",
            param="logit_bias",
            code="invalid_token_id",
        )
    max_model_len = limits.max_model_len
    num_prompt = len(prompt_token_ids)
    # room for one token unless max_tokens says otherwise: 0 (scoring the prompt) needs none
    num_total = num_prompt + (1 if params.max_tokens is None else params.max_tokens)
    if num_total > max_model_len:
        requested = (
            f"{num_total} tokens ({num_prompt} in the prompt, {params.max_tokens} in the "
            "completion)"
            if params.max_tokens
            else f"{num_prompt} tokens in the prompt"
        )
        raise PromptTooLongError(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"you requested {requested}. Please reduce the length of the prompt or "
            "max_tokens.",
            num_prompt_tokens=num_prompt,
            max_model_len=max_model_len,
            param="prompt" if num_prompt >= max_model_len else "max_tokens",
        )
    num_output = max_model_len if params.max_tokens is None else params.max_tokens
    num_needed = min(num_prompt + num_output, max_model_len)
    if num_blocks_for(num_needed, limits.block_size) > limits.num_usable_blocks:
        raise PromptTooLongError(
            f"This request needs {num_needed} tokens of KV cache but only "
            f"{limits.num_usable_blocks * limits.block_size} fit beside the pinned prefixes.",
            num_prompt_tokens=num_prompt,
            max_model_len=max_model_len,
        )
