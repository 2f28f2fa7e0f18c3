"""Per-request generation parameters, validated once at admission."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from engine.core.errors import InvalidRequestError

# Bounds the API validates against too (gateway/protocol imports them from here).
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value: -100 bans, +100 all but forces
GRAMMAR_PARAM = "grammar"  # the engine's name for a constraint; the gateway names its field
GrammarKind = Literal["json_schema", "regex", "choice", "lark"]
ANY_JSON_OBJECT = '{"type": "object"}'


@dataclass(frozen=True, slots=True)
class ThinkFirst:
    """A thinking model's think block before a constrained answer: the tags' token ids, the
    closing tag's text, and whether the prompt already opened the block (then the answer must
    close it first)."""

    open_id: int
    close_id: int
    close_tag: str
    opened: bool


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint as the client stated it: `source` is a JSON schema (JSON text), a regex,
    a JSON list of choice strings, or a Lark grammar (llguidance's Lark, GBNF accepted).
    `think_first`: the constraint holds from the end of a think block the answer may open
    (must close, where the prompt opened it) rather than from its first token, as vLLM's
    structured outputs do with a reasoning parser; the reasoning itself is free text."""

    kind: GrammarKind
    source: str
    think_first: ThinkFirst | None = None

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | None = None) -> GrammarSpec:
        """`None`: any JSON object (response_format json_object). Key order is kept: the
        output's properties come in the schema's order."""
        text = ANY_JSON_OBJECT if schema is None else json.dumps(schema)
        return cls("json_schema", text)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> GrammarSpec:
        return cls("choice", json.dumps(list(choices)))

    def after_thinking(self, think_first: ThinkFirst) -> GrammarSpec:
        return replace(self, think_first=think_first)

    @property
    def key(self) -> str:
        text = f"{self.kind}\0{self.source}"
        if (think := self.think_first) is not None:
            text += f"\0think {think.open_id} {think.close_id} {think.close_tag} {think.opened}"
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What to generate and when to stop. `temperature == 0` means greedy.

    `max_tokens=None` means "until EOS or `max_model_len`"; `max_tokens=0` only scores the
    prompt (with `prompt_logprobs`). `logprobs=None` returns none; `logprobs=k` returns the
    chosen token's logprob plus the top-k alternatives. `prompt_logprobs=k` does the same for
    every prompt token after the first (scoring needs every position computed, so such a
    request shares no cached prefix).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    grammar: GrammarSpec | None = None  # structured output: what the text must match
    # The grammar's text starts this many tokens before the prompt's end: text the client's
    # request fixes in advance (a tool call's opening tag, a named function's name) is put
    # in the prompt, so it takes no decode step and no share of max_tokens, and the grammar
    # reads those tokens before the first sampled one
    num_grammar_prompt_tokens: int = 0
    prompt_logprobs: int | None = None
    speculative: bool = True  # False: this request never takes drafted tokens (opt-out)
    # (token id, value) added to that token's logit at every step, before the grammar's mask,
    # penalties and sampling; its logprobs are of the biased logits, as of a grammar's mask
    logit_bias: tuple[tuple[int, float], ...] = ()
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _check(
            self.max_tokens is None or self.max_tokens >= 1 or self.prompt_logprobs is not None,
            "max_tokens must be >= 1 (0 only to score a prompt with prompt_logprobs)",
            "max_tokens",
        )
        _check(
            self.max_tokens is None or self.max_tokens >= 0, "max_tokens must be >= 0", "max_tokens"
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}",
            "prompt_logprobs",
        )
        _check(0.0 <= self.temperature <= 2.0, "temperature must be in [0, 2]", "temperature")
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p")
        _check(self.top_k >= -1, "top_k must be -1, 0 (disabled) or a positive integer", "top_k")
        _check(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", "min_p")
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty must be in [-2, 2]",
            "presence_penalty",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty must be in [-2, 2]",
            "frequency_penalty",
        )
        _check(
            0.0 < self.repetition_penalty <= 2.0,
            "repetition_penalty must be in (0, 2]",
            "repetition_penalty",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            f"logprobs must be between 0 and {MAX_LOGPROBS}",
            "logprobs",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop strings must be non-empty",
            "stop",
        )
        _check(
            len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings", "stop"
        )
        _check(
            self.num_grammar_prompt_tokens == 0
            or (self.num_grammar_prompt_tokens > 0 and self.grammar is not None),
            "num_grammar_prompt_tokens needs a grammar and must be >= 0",
            GRAMMAR_PARAM,
        )
        _check(self.seed is None or -(2**63) <= self.seed < 2**63, "seed must fit in int64", "seed")
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be non-negative integers",
            "stop_token_ids",
        )
        ids = [token_id for token_id, _ in self.logit_bias]
        _check(
            all(isinstance(t, int) and t >= 0 for t in ids) and len(set(ids)) == len(ids),
            "logit_bias keys must be distinct token ids",
            "logit_bias",
        )
        _check(
            all(-MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS for _, value in self.logit_bias),
            f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            "logit_bias",
        )

    def is_stop_token(self, token_id: int, eos_token_ids: Collection[int]) -> bool:
        """A token the request ends on without showing it: a stop token, or EOS unless
        ignored. The engine finishes on it; the text side turns it into no text."""
        if token_id in self.stop_token_ids:
            return True
        return token_id in eos_token_ids and not self.ignore_eos

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def may_fast_forward(self) -> bool:
        """Whether the tokens a grammar forces may join without a step each and still give
        this request what one step each would: not when it wants each token's logprobs
        (computed from its own step's logits) or samples with a seed (its generator draws
        once per sampled token, forced or not). A forced run that passes a stop string is cut
        there by the text (`RequestText`)."""
        return self.logprobs is None and (self.is_greedy or self.seed is None)

    @property
    def may_speculate(self) -> bool:
        """Whether drafted tokens may be verified for this request (engine/speculative/)
        and still give what one step a token gives: greedy (a draft is kept exactly when it
        is the argmax at its position) or sampled without a seed (a draft is kept with the
        probability the model gives it, so each token is drawn from the distribution one
        step would draw it from; a seeded generator's stream would be drawn differently).
        Logprobs come from each kept position's own row; a kept run that passes a stop
        string is cut there by the text (`RequestText`); under a grammar, drafts are only
        tokens it allows and each drafted position's row gets the mask one step would give
        it. Not with penalties (their counts change with every token)."""
        return self.speculative and (self.is_greedy or self.seed is None) and not self.has_penalties

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)
