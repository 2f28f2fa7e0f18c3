"""Per-request state as the scheduler and runner see it."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.core.outputs import SampleLogprobs
from engine.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's tokens and KV blocks.

    `token_ids` is prompt + output. `num_computed_tokens` counts tokens whose K/V are in the
    blocks of `block_table`; the next forward feeds `token_ids[num_computed_tokens:]` (or a
    chunk of it). A preempted sequence drops its blocks and recomputes from zero, so the
    invariant is simply: blocks cover at least `num_computed_tokens` positions.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival_index: int
    generator: torch.Generator | None = None
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    # prompt tokens this sequence put in the automatic cache (blocks no copy held before)
    num_cache_written_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    cache_salt: str | None = None  # reuse of this sequence's own work stays within its salt
    tenant: str | None = None  # the API key name: which registered prefixes it may hit
    # Automatic prefix caching: the parent hash of the first block (its cache scope, set by the
    # cache manager when it first hashes), the hashes of its full blocks so far, and how many
    # of its computed blocks are indexed.
    cache_seed: bytes = b""
    block_hashes: list[bytes] = field(default_factory=list)
    num_indexed_blocks: int = 0
    # The prompt's hashes in the registry scopes it may search: shared, then its tenant's.
    registry_chains: list[list[bytes]] | None = None
    # Leading blocks shared with a registry prefix (full blocks only): on the torch path,
    # decodes that share them attend to them once per step as a group (cascade attention).
    num_shared_blocks: int = 0
    # Structured output: which tokens may come next. It has consumed every output token, so a
    # preempted sequence that recomputes its blocks keeps it as it is.
    matcher: LLMatcher | None = None
    # Scored prompt tokens (params.prompt_logprobs): None for the first, which has no context.
    prompt_logprobs: list[SampleLogprobs | None] = field(default_factory=list)
    # Set: a sequence that only computes its prompt (a registry fill). The logits of its last
    # position go to this hook instead of the sampler, once the scheduler has let go of it;
    # its blocks are not indexed for reuse by content (whoever the hook hands them to is).
    on_prefilled: Callable[[Sequence, torch.Tensor], None] | None = None
    # Speculative decoding (engine/speculative/): tokens proposed to follow `token_ids`, not
    # part of it until the forward that computes them agrees (the scheduler schedules a
    # prefix of them, maybe none), and the estimated chance that its next draft token is
    # accepted, from how its drafts fared so far.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_acceptance: float = 0.0

    @property
    def is_prompt_only(self) -> bool:
        return self.on_prefilled is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Its prompt is computed and what it feeds are output tokens: the last sampled one,
        and any its grammar forced after it (`LLMEngine._append`), all in one step. The
        scheduler treats it as a decode, however many tokens that is."""
        return self.num_prompt_tokens <= self.num_computed_tokens < self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
