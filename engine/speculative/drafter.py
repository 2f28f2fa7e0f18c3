"""The drafter: after each step, the next tokens each running request is likely to produce.

Drafts come from the longest recent n-gram match (engine/speculative/ngram.py) in the
request's own tokens (its prompt, so also a registered prefix it extends, and its output)
or in earlier answers of its scope (engine/speculative/answers.py). Whether a draft is worth
its forward rows is the scheduler's call (engine/scheduler/scheduler.py, `_add_drafts`),
from each sequence's `draft_acceptance`, which this module keeps: decayed counts of its draft
tokens accepted and rejected, so a request whose drafts keep failing soon gets none, and one
that copies runs of text gets long drafts.

Which requests may take drafts is `SamplingParams.may_speculate` (greedy or sampled without a
seed, no penalties): their output is the same with drafts as without. Under a grammar a draft
holds only tokens it allows, and each drafted position's row is masked as one step would mask
it (`runner._grammar_chain`). Greedy, because a draft token is kept only where it equals the
argmax of the logits the model computes at its position, bit for bit what a one-token step
computes there; sampled, because a draft is kept with the probability the model gives it and a
rejected one is replaced by a draw from the rest (`ModelRunner._verify`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.sequence import Sequence
from engine.speculative.answers import AnswerIndex, AnswerScope
from engine.speculative.ngram import Match, TokenBuffer, find_continuation

MIN_NGRAM = 2
MAX_NGRAM = 4
DECAY = 0.8  # weight of earlier verifications in a sequence's acceptance estimate
SCOPE_DECAY = 0.98  # the same over a scope's requests: a new request's prior
PRIOR_WEIGHT = 4.0  # verifications' worth of the scope's record a new request starts with
MAX_SCOPE_RECORDS = 1024


@dataclass(slots=True)
class _Drafting:
    """One request's own tokens (as searched) and its drafts' record."""

    scope: AnswerScope
    tokens: TokenBuffer = field(default_factory=TokenBuffer)
    accepted: float = 0.0  # decayed counts of its draft tokens
    rejected: float = 0.0

    @property
    def acceptance(self) -> float:
        """The chance its next draft token is accepted (a uniform prior: 1/2 at first)."""
        return (self.accepted + 1.0) / (self.accepted + self.rejected + 2.0)


@dataclass(frozen=True, slots=True)
class DraftCounts:
    """Draft tokens the forward verified, and how many of them it accepted."""

    drafted: int = 0
    accepted: int = 0


class Drafter:
    """Engine-thread only: the LLMEngine calls it as requests come, step and go."""

    def __init__(self, max_draft_tokens: int, max_model_len: int) -> None:
        self.max_draft_tokens = max_draft_tokens
        self.max_model_len = max_model_len
        self.answers = AnswerIndex()
        self._live: dict[str, _Drafting] = {}
        # How drafts fared in each scope (decayed accepted, rejected): a new request's
        # prior, so one whose scope's answers copy well starts with drafts even in a busy
        # step, where an unproven sequence's even odds would not pay.
        self._scope_record: dict[AnswerScope, tuple[float, float]] = {}
        # Per registry entry ("" for requests that hit none). Values are replaced, never
        # changed, and `counts` copies the dict in one C call: a metrics scrape on another
        # thread reads it while steps run.
        self._counts: dict[str, DraftCounts] = {}

    def start(self, seq: Sequence, entry: str | None) -> None:
        """Follow `seq` (a request that may take drafts) from now on."""
        state = _Drafting((seq.tenant, seq.cache_salt, entry))
        accepted, rejected = self._scope_record.get(state.scope, (0.0, 0.0))
        if accepted + rejected > 0:
            scale = min(1.0, PRIOR_WEIGHT / (accepted + rejected))
            state.accepted, state.rejected = accepted * scale, rejected * scale
        state.tokens.extend(seq.token_ids)
        self._live[seq.request_id] = state
        seq.draft_acceptance = state.acceptance

    def propose(self, seq: Sequence, bar: float = 0.0) -> None:
        """Set `seq.draft_token_ids` to what may follow its tokens (none when nothing
        matches or its length limits leave no room). `bar`: the acceptance a first draft
        token needs to be taken beside the current decodes (`Scheduler.draft_bar`); below
        it no search is made, as the scheduler would drop what it found (a busy batch)."""
        seq.draft_token_ids = []
        state = self._live.get(seq.request_id)
        if state is None or state.acceptance < bar:
            return
        state.tokens.extend(seq.token_ids[state.tokens.size :])
        k = self._room(seq)
        if k <= 0:
            return
        own = state.tokens.view
        suffix = own[-MAX_NGRAM:]
        match = find_continuation(own, suffix, MIN_NGRAM, MAX_NGRAM, k)
        if match is None or match.n < MAX_NGRAM:
            earlier = self.answers.find(state.scope, suffix, MIN_NGRAM, MAX_NGRAM, k)
            match = _longer(match, earlier)
        if match is not None:
            drafts = match.continuation
            if seq.matcher is not None:  # only what its grammar allows (the rest never joins)
                drafts = drafts[: seq.matcher.validate_tokens(drafts)]
            seq.draft_token_ids = drafts

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """A forward verified `num_drafted` of `seq`'s draft tokens and kept `num_accepted`."""
        state = self._live.get(seq.request_id)
        if state is None or num_drafted == 0:
            return
        rejected = float(num_accepted < num_drafted)
        state.accepted = DECAY * state.accepted + num_accepted
        state.rejected = DECAY * state.rejected + rejected
        seq.draft_acceptance = state.acceptance
        scope_accepted, scope_rejected = self._scope_record.pop(state.scope, (0.0, 0.0))
        self._scope_record[state.scope] = (  # most recently used last
            SCOPE_DECAY * scope_accepted + num_accepted,
            SCOPE_DECAY * scope_rejected + rejected,
        )
        if len(self._scope_record) > MAX_SCOPE_RECORDS:
            del self._scope_record[next(iter(self._scope_record))]
        entry = state.scope[2] or ""
        before = self._counts.get(entry, DraftCounts())
        self._counts[entry] = DraftCounts(
            before.drafted + num_drafted, before.accepted + num_accepted
        )

    def finish(self, seq: Sequence, remember: bool) -> None:
        """`seq` is done; with `remember`, its answer becomes a draft source for its scope."""
        state = self._live.pop(seq.request_id, None)
        if state is not None and remember:
            self.answers.add(state.scope, seq.prompt_token_ids, seq.output_token_ids)

    def counts(self) -> dict[str, DraftCounts]:
        """Per registry entry ("": none), since the start; safe from any thread."""
        return self._counts.copy()

    def _room(self, seq: Sequence) -> int:
        """Draft tokens that could all be kept: a step keeps the accepted ones plus one more
        token, within max_tokens and the context length."""
        room = min(self.max_draft_tokens, self.max_model_len - seq.num_tokens - 1)
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return room


def _longer(first: Match | None, second: Match | None) -> Match | None:
    """The match of the longer suffix; `first` on a tie."""
    if first is None:
        return second
    if second is None or second.n <= first.n:
        return first
    return second
