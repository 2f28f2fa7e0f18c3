"""What the engine hands back per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class SampleLogprobs:
    """Logprob of the sampled token plus the top-k alternatives (from the raw model logits,
    after a structured output's mask: disallowed tokens have probability 0)."""

    token_id: int
    logprob: float
    top: tuple[TokenLogprob, ...] = ()


@dataclass(slots=True)
class RequestOutput:
    """One step's delta for one request.

    `text` and `token_ids` are new since the previous output of the same request. Counts are
    totals so far. `finish_reason` is None while the request runs, else "stop", "length" or
    "abort"; `stop_reason` says which stop string or token id ended it, if one did.
    """

    request_id: str
    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[SampleLogprobs] | None = None
    # On a request's first output when it asked for prompt_logprobs: one per prompt token.
    prompt_logprobs: list[SampleLogprobs | None] | None = None
    error: str | None = field(default=None)
    # Set with the text: per token of `token_ids`, where its text starts in `text` (a delta
    # may hold several tokens: forced, drafted, merged steps)
    text_offsets: list[int] | None = None
    # prompt tokens the request put in the automatic cache (the Responses API's
    # `cache_write_tokens`): its full prompt blocks whose content the cache did not hold
    num_cache_written_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """This delta and the next one of the same request as one delta (a stream that sends
        several steps at once)."""
        assert later.request_id == self.request_id
        logprobs = (
            None
            if self.logprobs is None and later.logprobs is None
            else [*(self.logprobs or []), *(later.logprobs or [])]
        )
        return replace(
            later,
            text=self.text + later.text,
            token_ids=[*self.token_ids, *later.token_ids],
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
            text_offsets=[*self.offsets(), *(len(self.text) + o for o in later.offsets())],
        )

    def truncated(self, num_tokens: int) -> RequestOutput:
        """This delta's first `num_tokens` tokens (and their logprobs), the counts with it:
        a stop string ended the request there."""
        dropped = len(self.token_ids) - num_tokens
        return replace(
            self,
            token_ids=self.token_ids[:num_tokens],
            logprobs=self.logprobs[:num_tokens] if self.logprobs is not None else None,
            num_completion_tokens=self.num_completion_tokens - dropped,
            text_offsets=(
                self.text_offsets[:num_tokens] if self.text_offsets is not None else None
            ),
        )

    def offsets(self) -> list[int]:
        """`text_offsets`, or (an output without text) every token at the start."""
        if self.text_offsets is not None:
            return self.text_offsets
        return [0] * len(self.token_ids)
