"""Structured outputs: a grammar decides which tokens a sequence may sample next.

Every kind of constraint the API offers (a JSON schema, any JSON object, a regex, a list of
choices, a Lark grammar) becomes one llguidance grammar: there is one mechanism under all of
them. `GrammarCompiler` builds llguidance's view of the tokenizer once (its EOS is the model's
end of turn) and compiles each distinct grammar once, into a matcher that is copied for every
sequence that uses it. Each step, the constrained rows of a batch get their allowed-token
bitmask applied to the logits before sampling (so greedy, sampling, penalties and logprobs
all see the masked distribution), and each sampled token advances its sequence's matcher.
Unconstrained rows pay nothing.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
import torch

from engine.core.errors import InvalidRequestError
from engine.core.sampling_params import GRAMMAR_PARAM, GrammarSpec, ThinkFirst

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

    from engine.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Compact JSON: a small model given free whitespace tends to emit runs of it, and every
# blank costs a decode step.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
MAX_CACHED_GRAMMARS = 256


def to_llguidance(spec: GrammarSpec) -> str:
    """The llguidance grammar of `spec`; raises InvalidRequestError for a source it cannot
    read (most grammar errors only show when compiling: see GrammarCompiler.compile)."""
    try:
        if spec.kind == "json_schema":
            answer = llguidance.LLMatcher.grammar_from_json_schema(
                spec.source, defaults=JSON_OPTIONS
            )
        elif spec.kind == "regex":
            answer = llguidance.LLMatcher.grammar_from_regex(spec.source)
        elif spec.kind == "choice":
            answer = _choice_grammar(json.loads(spec.source))
        else:
            answer = llguidance.grammar_from("grammar", spec.source)
    except ValueError as exc:
        raise _invalid(spec, str(exc)) from exc
    return answer if spec.think_first is None else _after_thinking(answer, spec.think_first)


def check_grammar(spec: GrammarSpec) -> None:
    """Raise InvalidRequestError (param "grammar") where llguidance finds `spec` wrong without
    a tokenizer: what a schema, regex or grammar says (what depends on the tokens, such as a
    token a grammar names, shows when compiled). Takes well under a millisecond, where the
    compiler's view of the tokenizer takes ~0.35 s to build (SmolLM2)."""
    error = llguidance.LLMatcher.validate_grammar(to_llguidance(spec))
    if error:
        raise _invalid(spec, error)


# After the block, the blank lines thinking models write before the answer: a few at most.
_GAP = "GAP: /[ \\t\\r\\n]{0,8}/\n"


def _after_thinking(answer: str, think: ThinkFirst) -> str:
    """`answer` (an llguidance grammar) after a think block: llguidance's own recipe for
    reasoning models (its syntax guide, "Reasoning/thinking"), the answer referenced as a
    grammar of its own. The block is optional unless the prompt opened it."""
    [grammar] = _grammars(answer)
    block = f"THINKING <[{think.close_id}]> GAP"
    if not think.opened:
        block = f"(<[{think.open_id}]> {block})?"
    # the block's text: up to the closing tag (a token: text never matches it), and not
    # spelling the tag out either (the reasoning splitter would end the block there)
    tag = re.escape(think.close_tag).replace("/", "\\/")
    thinking = f"THINKING: /(.|\\n)*/ & ~/(.|\\n)*{tag}(.|\\n)*/\n"
    start = {"lark_grammar": f"start: {block} @answer\n{thinking}{_GAP}"}
    return json.dumps({"grammars": [start, {**grammar, "name": "answer"}]})


_NAMES = {
    "json_schema": "JSON schema",
    "regex": "regex",
    "choice": "choice list",
    "lark": "grammar",
}


def _invalid(spec: GrammarSpec, reason: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"invalid {_NAMES[spec.kind]}: {reason}", GRAMMAR_PARAM, code="invalid_value"
    )


def _choice_grammar(choices: list[str]) -> str:
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choices must be a non-empty list of non-empty strings")
    # Lark string literals are JSON strings; `start: "a" | "b"` matches exactly one of them.
    return llguidance.LLMatcher.grammar_from_lark(
        "start: " + " | ".join(json.dumps(c) for c in choices)
    )


def _grammars(text: str) -> list[dict[str, Any]]:
    """The grammars of an llguidance grammar string: a JSON object of them (what llguidance
    makes of a JSON schema or a regex) or a Lark grammar's text (what it makes of Lark)."""
    try:
        top = json.loads(text)
    except ValueError:
        return [{"lark_grammar": text}]
    grammars: list[dict[str, Any]] = top["grammars"]
    return grammars


class CompiledGrammar:
    """A grammar compiled against the model's tokenizer: `new_matcher()` per sequence."""

    def __init__(self, spec: GrammarSpec, matcher: llguidance.LLMatcher) -> None:
        self.spec = spec
        self._template = matcher

    def new_matcher(self) -> llguidance.LLMatcher:
        return self._template.deep_copy()

    def started(self, tokens: Sequence[int]) -> CompiledGrammar:
        """This grammar having read `tokens` (its start, where the prompt holds it:
        `SamplingParams.num_grammar_prompt_tokens`), read once for every sequence of the
        request; ValueError if the grammar does not allow them."""
        matcher = self.new_matcher()
        if not matcher.consume_tokens(list(tokens)):
            raise ValueError(matcher.get_error() or "the grammar does not start with them")
        return CompiledGrammar(self.spec, matcher)


class GrammarCompiler:
    """Thread-safe: the gateway's workers compile while validating requests; the engine
    thread only copies compiled matchers. llguidance drops the GIL while it compiles."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: frozenset[int]
    ) -> None:
        self.tokenizer = _llguidance_tokenizer(tokenizer, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar of `spec`, from the cache when it was compiled before; raises
        InvalidRequestError (param "grammar") with llguidance's reason when it cannot be."""
        key = spec.key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        matcher = llguidance.LLMatcher(self.tokenizer, to_llguidance(spec), log_level=0)
        if matcher.is_error():
            raise _invalid(spec, matcher.get_error())
        compiled = CompiledGrammar(spec, matcher)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled


def _llguidance_tokenizer(
    tokenizer: Tokenizer, vocab_size: int, eos_token_ids: frozenset[int]
) -> llguidance.LLTokenizer:
    """llguidance's view of the tokenizer, from its serialized Rust tokenizer, as
    `llguidance.hf.from_tokenizer` makes it; that one copies the tokenizer first (0.18 s for
    SmolLM2's) to switch off padding and truncation, which our Tokenizer never has."""
    backend = tokenizer.backend_tokenizer
    return llguidance.LLTokenizer(
        backend.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
    )


class GrammarMasker:
    """Applies the constrained rows' allowed-token bitmasks to a batch's logits.

    `parallel`: compute the masks on llguidance's thread pool. Right for a GPU host, whose
    cores idle while the device runs; on a CPU engine torch's OpenMP threads own the cores,
    and the pool's threads fighting them cost 5-10% of a batch-32 decode step (2 cores),
    against 1.3% for the same masks computed one after another on the engine thread."""

    def __init__(self, vocab_size: int, parallel: bool) -> None:
        self.vocab_size = vocab_size
        self._num_words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor() if parallel else None

    def apply(self, logits: torch.Tensor, matchers: Sequence[llguidance.LLMatcher | None]) -> None:
        """In place: each row whose matcher is not None keeps only the tokens it allows.
        `logits` is [rows, >= vocab_size]; columns past the tokenizer's vocabulary (padding
        of the LM head) are never allowed."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        blocked = torch.from_numpy(self._blocked([m for m in matchers if m is not None]))
        if blocked.shape[1] < logits.shape[1]:  # [k, vocab] -> [k, logits width]
            padding = torch.ones((len(rows), logits.shape[1] - blocked.shape[1]), dtype=torch.bool)
            blocked = torch.cat([blocked, padding], dim=1)
        blocked = blocked.to(logits.device)
        if len(rows) == logits.shape[0]:
            logits.masked_fill_(blocked, float("-inf"))
        else:
            index = torch.tensor(rows, device=logits.device)
            logits[index] = logits[index].masked_fill(blocked, float("-inf"))

    def _blocked(self, matchers: list[llguidance.LLMatcher]) -> np.ndarray:
        """[k, vocab_size] bool: True where the row's grammar forbids the token. llguidance
        writes one bit per token (32-bit words, little-endian as on x86 and ARM) into our
        buffer;
        unpackbits turns them into bytes in C (a torch shift-and-mask was 10x slower here)."""
        bitmask = np.empty((len(matchers), self._num_words), dtype=np.int32)  # [k, words]
        row_bytes = self._num_words * 4
        if self._executor is not None:
            pairs = [(m, k) for k, m in enumerate(matchers)]
            self._executor.unsafe_compute_mask_ptr(
                pairs, bitmask.ctypes.data, row_bytes, len(matchers)
            )
        else:
            for k, matcher in enumerate(matchers):
                matcher.unsafe_compute_mask_ptr(bitmask[k].ctypes.data, row_bytes)
        bits = np.unpackbits(
            bitmask.view(np.uint8), axis=1, count=self.vocab_size, bitorder="little"
        )
        blocked: np.ndarray = np.equal(bits, 0)
        return blocked
