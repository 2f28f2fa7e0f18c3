"""EngineRequest: a prompt and its sampling parameters, validated once, trusted after."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured.grammar import CompiledGrammar


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """What the engine serves for one request id.

    Made only by `LLMEngine.prepare_request` (or `AsyncEngine.prepare_request`), which raises
    a typed error for anything the engine cannot serve; everything downstream (the engine
    thread's admission, the scheduler) trusts it instead of validating again. A request fanned
    out into n choices is prepared once and copied with `with_params` (per-choice seeds).

    `cache_salt` scopes reuse of this request's own work: only requests with the same salt
    share cached blocks and in-step deduplicated prefills. `None` is the one shared scope.
    `tenant` (an API key name) decides which registered prefixes the request may hit.
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    grammar: CompiledGrammar | None = None  # params.grammar, compiled (each choice copies it)
    tenant: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def with_params(self, params: SamplingParams) -> EngineRequest:
        """The same prompt under other sampling parameters, still validated: the checks that
        depend on parameters (length) read only `max_tokens`, which must not change."""
        assert params.max_tokens == self.params.max_tokens, "max_tokens was validated"
        assert params.grammar == self.params.grammar, "the grammar was compiled"
        return EngineRequest(
            self.prompt_token_ids, params, self.cache_salt, self.grammar, self.tenant
        )
