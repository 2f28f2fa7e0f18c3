"""Structured outputs in the engine: every kind of grammar on the tiny Llama, greedy and sampled,
batched beside unconstrained rows, through preemption, with logprobs, and bad grammars."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast

from engine import InvalidRequestError, LLMEngine, SamplingParams
from engine.core.sampling_params import GrammarSpec, ThinkFirst
from engine.structured.grammar import GrammarCompiler, GrammarMasker
from engine.text.tokenizer import Tokenizer
from tests.helpers import assert_all_free, tiny_engine, tokens_of

PROMPT = "Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 appear in text too"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "intent": {"enum": ["billing", "refund", "other"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["intent", "score", "tags"],
    "additionalProperties": False,
}


_engine = tiny_engine


@pytest.fixture(scope="module")
def engine(tiny_llama_path: Path) -> LLMEngine:
    return _engine(tiny_llama_path)


def _run(engine: LLMEngine, requests: dict[str, SamplingParams], prompt: str = PROMPT) -> Any:
    ids = engine.tokenizer.encode(prompt)
    for request_id, params in requests.items():
        engine.add_request(request_id, ids, params)
    outputs: dict[str, list[Any]] = {request_id: [] for request_id in requests}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id].append(output)
    assert_all_free(engine)
    return outputs


def _text(engine: LLMEngine, outputs: list[Any]) -> str:
    return str(engine.tokenizer.decode(tokens_of(outputs), skip_special_tokens=True))


def _greedy(grammar: GrammarSpec, **overrides: Any) -> SamplingParams:
    settings: dict[str, Any] = {"temperature": 0, "max_tokens": 60, "grammar": grammar}
    return SamplingParams(**{**settings, **overrides})


def test_a_choice_is_one_of_the_choices_and_stops_without_an_eos_step(engine: LLMEngine) -> None:
    choices = ["billing question", "refund", "other"]
    outputs = _run(engine, {"a": _greedy(GrammarSpec.choice(choices))})["a"]
    text = _text(engine, outputs)
    assert text in choices
    assert outputs[-1].finish_reason == "stop"
    # Complete after the choice's last token: no token was spent on the end of turn.
    assert engine.eos_token_ids.isdisjoint(tokens_of(outputs))
    assert "".join(o.text for o in outputs) == text


def test_a_regex_is_matched_whole(engine: LLMEngine) -> None:
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    outputs = _run(engine, {"a": _greedy(GrammarSpec("regex", pattern))})["a"]
    assert re.fullmatch(pattern, _text(engine, outputs))
    assert outputs[-1].finish_reason == "stop"


def test_a_lark_grammar(engine: LLMEngine) -> None:
    grammar = 'start: "yes" | "no" | "n=" NUMBER\nNUMBER: /[0-9]+/'
    outputs = _run(engine, {"a": _greedy(GrammarSpec("lark", grammar), max_tokens=8)})["a"]
    assert re.fullmatch(r"yes|no|n=[0-9]+", _text(engine, outputs))


@pytest.mark.parametrize("seed", [None, 1, 2, 3])
def test_json_schema_output_validates_greedy_and_sampled(
    engine: LLMEngine, seed: int | None
) -> None:
    temperature = 0.0 if seed is None else 1.0
    params = SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=80,
        grammar=GrammarSpec.json_schema(SCHEMA),
        ignore_eos=True,  # the grammar still ends the request
    )
    outputs = _run(engine, {"a": params})["a"]
    value = json.loads(_text(engine, outputs))
    jsonschema.validate(value, SCHEMA)
    assert list(value) == ["intent", "score", "tags"]  # the schema's order, compact
    assert outputs[-1].finish_reason == "stop"


def test_any_json_object(engine: LLMEngine) -> None:
    """The random tiny model writes an endless object; every token it wrote is one the
    grammar accepts (a fresh matcher takes them all) and the text starts an object."""
    spec = GrammarSpec.json_schema(None)
    outputs = _run(engine, {"a": _greedy(spec, max_tokens=40)})["a"]
    tokens = tokens_of(outputs)
    assert (len(tokens), outputs[-1].finish_reason) == (40, "length")
    assert engine.grammars.compile(spec).new_matcher().validate_tokens(tokens) == 40
    assert _text(engine, outputs).startswith("{")


def test_unconstrained_rows_in_the_same_batch_are_unchanged(
    engine: LLMEngine, tiny_llama_path: Path
) -> None:
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = tokens_of(_run(_engine(tiny_llama_path), {"free": free})["free"])
    mixed = _run(engine, {"json": _greedy(GrammarSpec.json_schema(SCHEMA)), "free": free})
    assert tokens_of(mixed["free"]) == alone
    jsonschema.validate(json.loads(_text(engine, mixed["json"])), SCHEMA)


def test_preemption_keeps_the_grammar_state(tiny_llama_path: Path) -> None:
    """A pool too small for four 60-token outputs at once: sequences are preempted and
    recomputed, and each output is still exactly what it is alone."""
    params = _greedy(GrammarSpec.json_schema(SCHEMA), max_tokens=60, ignore_eos=True)
    alone = _text(_engine(tiny_llama_path), _run(_engine(tiny_llama_path), {"a": params})["a"])
    small = _engine(tiny_llama_path, num_kv_blocks=24, max_model_len=96)
    outputs = _run(small, {str(i): params for i in range(4)})
    assert small.scheduler.num_preemptions > 0
    assert [_text(small, outputs[str(i)]) for i in range(4)] == [alone] * 4


def test_logprobs_see_the_masked_distribution(engine: LLMEngine) -> None:
    choices = ["alpha", "beta"]
    params = _greedy(GrammarSpec.choice(choices), logprobs=5)
    outputs = _run(engine, {"a": params})["a"]
    first = outputs[0].logprobs[0]
    allowed = {
        engine.tokenizer.encode("alpha", add_special_tokens=False)[0],
        engine.tokenizer.encode("beta", add_special_tokens=False)[0],
    }
    # Only tokens the grammar allows have finite logprobs, and they carry all the mass.
    finite = {t.token_id: t.logprob for t in first.top if t.logprob > -math.inf}
    assert set(finite) <= allowed | _prefixes_of(engine, choices)
    assert math.isclose(sum(math.exp(lp) for lp in finite.values()), 1.0, rel_tol=1e-4)


def _prefixes_of(engine: LLMEngine, choices: list[str]) -> set[int]:
    """Every token that spells a prefix of a choice (BPE may start a word with a piece)."""
    vocab = engine.tokenizer.get_vocab()
    return {
        i
        for token, i in vocab.items()
        for c in choices
        if (text := engine.tokenizer.backend_tokenizer.decoder.decode([token]))
        and c.startswith(text)
    }


def test_n_choices_each_keep_their_own_matcher(engine: LLMEngine) -> None:
    params = [
        SamplingParams(
            temperature=1.0, seed=s, max_tokens=80, grammar=GrammarSpec.json_schema(SCHEMA)
        )
        for s in range(3)
    ]
    outputs = _run(engine, {str(i): p for i, p in enumerate(params)})
    for i in range(3):
        jsonschema.validate(json.loads(_text(engine, outputs[str(i)])), SCHEMA)


@pytest.mark.parametrize(
    ("grammar", "reason"),
    [
        (GrammarSpec.json_schema({"type": "strin"}), "invalid JSON schema: "),
        (GrammarSpec("json_schema", "{not json"), "invalid JSON schema: "),
        (GrammarSpec("regex", "a(b"), "invalid regex: "),
        (GrammarSpec.choice([]), "invalid choice list: choices must be a non-empty list"),
        (GrammarSpec("lark", "start: undefined_rule"), "invalid grammar: "),
    ],
)
def test_a_bad_grammar_is_a_typed_error_before_the_engine(
    engine: LLMEngine, grammar: GrammarSpec, reason: str
) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        engine.prepare_request([1, 2, 3], SamplingParams(grammar=grammar))
    assert raised.value.param == "grammar"
    assert raised.value.message.startswith(reason)
    assert len(raised.value.message) > len(reason)


def test_a_grammar_that_starts_in_the_prompt_reads_it_there(engine: LLMEngine) -> None:
    """The prompt's last tokens are the grammar's start (a forced tool call's opening): the
    output is the rest of the text, and those tokens are prompt, not output: no step, no
    share of max_tokens. Greedy, the text is what the grammar gives a request that writes
    the start itself (the start's tokens here are the grammar's own forced ones)."""
    grammar = GrammarSpec("lark", 'start: "n=" NUMBER " ok"\nNUMBER: /[0-9]{2}/')
    whole = _run(engine, {"a": _greedy(grammar)})["a"]
    whole_text = _text(engine, whole)
    assert re.fullmatch(r"n=[0-9]{2} ok", whole_text)
    start = engine.tokenizer.encode("n=", add_special_tokens=False)
    ids = engine.tokenizer.encode(PROMPT) + start
    params = _greedy(grammar, num_grammar_prompt_tokens=len(start))
    engine.add_request("b", ids, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert_all_free(engine)
    assert "n=" + _text(engine, outputs) == whole_text
    assert outputs[-1].num_prompt_tokens == len(ids)
    assert outputs[-1].num_completion_tokens == len(tokens_of(whole)) - len(start)
    assert outputs[-1].finish_reason == "stop"


@pytest.mark.parametrize(
    ("prompt", "num", "message"),
    [
        ([1, 2, 3], 3, "the grammar's start must leave a prompt before it"),
        ([1, 2, 3], 1, "the grammar does not allow the prompt's last 1 tokens"),
    ],
    ids=["whole_prompt", "refused"],
)
def test_a_grammar_start_the_grammar_refuses_is_a_typed_error(
    engine: LLMEngine, prompt: list[int], num: int, message: str
) -> None:
    grammar = GrammarSpec("regex", "zzzz")
    params = SamplingParams(grammar=grammar, num_grammar_prompt_tokens=num)
    with pytest.raises(InvalidRequestError) as raised:
        engine.prepare_request(prompt, params)
    assert raised.value.param == "grammar"
    assert raised.value.message.startswith(message)
    with pytest.raises(InvalidRequestError, match="needs a grammar"):
        SamplingParams(num_grammar_prompt_tokens=1)


def test_each_grammar_is_compiled_once(engine: LLMEngine) -> None:
    spec = GrammarSpec.json_schema(SCHEMA)
    assert engine.grammars.compile(spec) is engine.grammars.compile(GrammarSpec.json_schema(SCHEMA))


def test_a_token_the_grammar_refuses_fails_that_request_alone(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the mask were wrong (here: not applied), the matcher refuses the token: that
    request fails with an error, the unconstrained one beside it finishes normally."""
    monkeypatch.setattr(GrammarMasker, "apply", lambda self, logits, matchers: None)
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = _run(engine, {"bad": _greedy(GrammarSpec("regex", "zzzz")), "free": free})
    assert outputs["bad"][-1].finish_reason == "abort"
    assert outputs["bad"][-1].error is not None
    assert "the grammar refused token" in outputs["bad"][-1].error
    assert outputs["free"][-1].finish_reason == "length"


def test_parallel_and_serial_masks_agree(engine: LLMEngine) -> None:
    """The CUDA path computes masks on llguidance's pool, the CPU path one by one: same
    masks, applied to constrained rows only (row 1 has no grammar)."""
    compiled = engine.grammars.compile(GrammarSpec.json_schema(SCHEMA))
    matchers = [compiled.new_matcher(), None, compiled.new_matcher()]
    assert matchers[2] is not None and matchers[2].consume_tokens(
        engine.tokenizer.encode('{"intent":"re', add_special_tokens=False)
    )
    logits = torch.randn(3, engine.vocab_size + 7)  # an LM head padded past the vocabulary
    results = []
    for parallel in (True, False):
        masked = logits.clone()
        GrammarMasker(engine.vocab_size, parallel=parallel).apply(masked, matchers)
        results.append(masked)
    assert torch.equal(results[0], results[1])
    parallel_result = results[0]
    assert torch.equal(parallel_result[1], logits[1])
    allowed = [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in parallel_result]
    assert engine.tokenizer.decode(sorted(allowed[0])).strip().startswith("{")
    # After '{"intent":"re' only "refund" can go on: each allowed piece continues 'fund"'.
    pieces = {engine.tokenizer.decode([t]) for t in allowed[2]}
    assert pieces and all('fund"'.startswith(p) or p.startswith('fund"') for p in pieces)


def test_llguidance_sees_the_tokenizer_as_its_own_wrapper_does(tiny_llama_path: Path) -> None:
    """Our view of the tokenizer skips `llguidance.hf.from_tokenizer`'s copy; it must be the
    same view (every token's bytes, the same tokenization), also from a transformers
    tokenizer with padding and truncation on (ours drops both; theirs is left as it was)."""
    import llguidance.hf
    from transformers import AutoTokenizer

    from engine.structured.grammar import _llguidance_tokenizer
    from engine.text.tokenizer import Tokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    tokenizer.backend_tokenizer.enable_padding(length=64)
    tokenizer.backend_tokenizer.enable_truncation(32)
    vocab = len(tokenizer)
    engine_tokenizer = Tokenizer.from_transformers(tokenizer)
    assert engine_tokenizer.backend_tokenizer.padding is None
    assert engine_tokenizer.backend_tokenizer.truncation is None
    ours = _llguidance_tokenizer(engine_tokenizer, vocab, frozenset({2, 3}))
    theirs = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=[2, 3])
    assert tokenizer.backend_tokenizer.padding is not None  # the caller's tokenizer unchanged
    assert tokenizer.backend_tokenizer.truncation is not None
    assert (ours.vocab_size, ours.eos_tokens, ours.is_canonical) == (
        theirs.vocab_size,
        theirs.eos_tokens,
        theirs.is_canonical,
    )
    assert [ours.decode_bytes([i]) for i in range(vocab)] == [
        theirs.decode_bytes([i]) for i in range(vocab)
    ]
    text = PROMPT * 8  # longer than the truncation: a truncating view would cut it
    assert ours.tokenize_str(text) == theirs.tokenize_str(text)
    assert len(ours.tokenize_str(text)) > 32


@pytest.fixture(scope="module")
def thinking_compiler(tiny_tokenizer: PreTrainedTokenizerFast) -> tuple[GrammarCompiler, Any]:
    """A compiler for the tiny tokenizer with `<think>` and `</think>` added as tokens (not
    special, as Qwen3 has them), and that tokenizer."""
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tiny_tokenizer.backend_tokenizer, eos_token="<|im_end|>"
    )
    hf.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tokenizer = Tokenizer.from_transformers(hf)
    return GrammarCompiler(tokenizer, len(hf), frozenset({hf.eos_token_id})), tokenizer


ANSWERS = [  # a grammar of each kind, an answer it takes, and a text it refuses
    (GrammarSpec.json_schema(SCHEMA), '{"intent":"refund","score":3,"tags":[]}', '{"score":3}'),
    (GrammarSpec("regex", "(yes|no)[.!]"), "no!", "maybe."),
    (GrammarSpec.choice(["billing", "refund"]), "refund", "other"),
    (GrammarSpec("lark", 'start: "n=" /[0-9]{1,3}/'), "n=42", "n=x"),
]


@pytest.mark.parametrize(("spec", "answer", "refused"), ANSWERS)
def test_a_constraint_after_thinking_holds_from_the_end_of_the_block(
    thinking_compiler: tuple[GrammarCompiler, Any], spec: GrammarSpec, answer: str, refused: str
) -> None:
    """Free text inside the block (text that would break the constraint too), the closing
    tag, a few blank lines, then the constraint; the block may be left out unless the prompt
    opened it, and an answer cannot close a block it never opened."""
    compiler, tokenizer = thinking_compiler
    vocab = tokenizer.get_added_vocab()
    open_id, close_id = vocab["<think>"], vocab["</think>"]

    def text(value: str) -> list[int]:
        return list(tokenizer.encode(value, add_special_tokens=False))

    def reads(think_first: ThinkFirst, ids: list[int]) -> str:
        """ "accepted" (a whole answer), "open" (a start of one) or "refused"."""
        matcher = compiler.compile(spec.after_thinking(think_first)).new_matcher()
        if not matcher.consume_tokens(ids):
            return "refused"
        return "accepted" if matcher.is_accepting() else "open"

    free = ThinkFirst(open_id, close_id, "</think>", False)
    opened = ThinkFirst(open_id, close_id, "</think>", True)
    thought = text(f"Not {refused} <b>, so\n{answer}?\n")
    gap = text("\n\n")
    assert reads(free, [open_id, *thought, close_id, *gap, *text(answer)]) == "accepted"
    assert reads(free, [open_id, close_id, *text(answer)]) == "accepted"
    assert reads(free, text(answer)) == "accepted"
    assert reads(free, [open_id, *thought, close_id, *gap, *text(refused)]) == "refused"
    assert reads(free, [close_id]) == "refused"
    assert reads(free, text(refused)) == "refused"
    assert reads(opened, [*thought, close_id, *gap, *text(answer)]) == "accepted"
    assert reads(opened, text(answer)) == "open"  # still thinking
    assert reads(opened, [open_id]) == "refused"
    assert reads(opened, [close_id, *text(refused)]) == "refused"
    # the closing tag spelled out in text does not end the block (the reasoning splitter
    # would end it there), nor may more than a few blank lines stand before the answer
    spelled = [*text("so </"), *text("think>")]
    assert close_id not in spelled
    assert reads(free, [open_id, *spelled]) == "refused"
    assert reads(free, [open_id, close_id, *text("\n" * 8), *text(answer)]) == "accepted"
    assert reads(free, [open_id, close_id, *text("\n" * 9)]) == "refused"
    # each shape is a grammar of its own
    keys = {spec.key, spec.after_thinking(free).key, spec.after_thinking(opened).key}
    assert len(keys) == 3


def test_a_bad_constraint_after_thinking_is_named_as_the_client_gave_it(
    thinking_compiler: tuple[GrammarCompiler, Any],
) -> None:
    """Errors of the client's source (read before the grammar is composed) and of the whole
    (compiling it, the think block around it) both name the client's kind."""
    compiler, _ = thinking_compiler
    think = ThinkFirst(1, 2, "</think>", False)
    with pytest.raises(InvalidRequestError, match=r"^invalid JSON schema: "):
        compiler.compile(GrammarSpec("json_schema", '{"type": "nope"}').after_thinking(think))
    with pytest.raises(InvalidRequestError, match=r"^invalid regex: "):
        compiler.compile(GrammarSpec("regex", "(").after_thinking(think))
    with pytest.raises(InvalidRequestError, match=r"^invalid grammar: .*nowhere") as raised:
        compiler.compile(GrammarSpec("lark", "start: nowhere").after_thinking(think))
    assert raised.value.param == "grammar"
