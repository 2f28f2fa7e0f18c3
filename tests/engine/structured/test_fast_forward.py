"""Grammar fast-forward: the tokens a grammar forces join without a decode step each, and
every request gets exactly what it gets without (tokens, finish, logprobs where it asks).

On the C++ kernel path (int4 weights), where a position's KV has the same bits in any chunk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import GrammarSpec, LLMEngine, SamplingParams
from engine.structured.grammar import GrammarMasker
from tests.engine.structured import test_grammar
from tests.helpers import assert_all_free, tiny_engine

# Longer labels than test_grammar's: once one is decided, the rest of it is forced.
INTENT = {"enum": ["billing_question", "refund_request", "other"]}
SCHEMA = {
    **test_grammar.SCHEMA,
    "properties": {**test_grammar.SCHEMA["properties"], "intent": INTENT},
}
PROMPT = test_grammar.PROMPT
GRAMMARS = {
    "schema": GrammarSpec.json_schema(SCHEMA),
    "choice": GrammarSpec.choice(["refund_request", "refund_status", "billing_question"]),
    "regex": GrammarSpec("regex", r"order-[0-9]{3}-(open|closed)"),
    "lark": GrammarSpec("lark", 'start: "call(" NAME ", " NAME ")"\nNAME: /[a-z]{1,6}/'),
}


def _engine(path: Path, fast_forward: bool, **overrides: Any) -> LLMEngine:
    return tiny_engine(
        path, quantization="int4", enable_grammar_fast_forward=fast_forward, **overrides
    )


def _run(
    engine: LLMEngine, requests: dict[str, SamplingParams], prompt: str = PROMPT
) -> dict[str, tuple[list[int], str | None, list[Any]]]:
    """Each request's tokens, finish reason and logprobs, all in one batch."""
    ids = engine.tokenizer.encode(prompt)
    for request_id, params in requests.items():
        engine.add_request(request_id, ids, params)
    answers: dict[str, tuple[list[int], str | None, list[Any]]] = {
        request_id: ([], None, []) for request_id in requests
    }
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, _, logprobs = answers[out.request_id]
            answers[out.request_id] = (
                tokens + out.token_ids,
                out.finish_reason,
                logprobs + (out.logprobs or []),
            )
    assert_all_free(engine)
    return answers


def _greedy(grammar: GrammarSpec, **overrides: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 60, "grammar": grammar, **overrides})


def test_forced_tokens_join_without_a_step_and_change_no_answer(tiny_llama_path: Path) -> None:
    requests = {name: _greedy(grammar) for name, grammar in GRAMMARS.items()}
    requests["unconstrained"] = SamplingParams(temperature=0, max_tokens=20)
    off, on = _engine(tiny_llama_path, False), _engine(tiny_llama_path, True)
    expected = _run(off, requests)
    assert _run(on, requests) == expected
    assert off.num_forced_tokens == 0
    assert on.num_forced_tokens >= 10  # `{"intent":"`, the labels' tails, "order-", ...
    assert on.num_steps < off.num_steps
    assert on.stats().num_forced_tokens == on.num_forced_tokens
    assert all(finish == "stop" for name, (_, finish, _) in expected.items() if name in GRAMMARS)


def test_a_forced_token_is_the_one_the_mask_allows(tiny_llama_path: Path) -> None:
    """What fast-forward rests on: wherever llguidance names forced tokens, the mask a step
    would apply allows the first of them alone, and that is the token the answer has."""
    engine = _engine(tiny_llama_path, True)
    answers = _run(engine, {name: _greedy(grammar) for name, grammar in GRAMMARS.items()})
    masker = GrammarMasker(engine.vocab_size, parallel=False)
    num_forced = 0
    for name, (tokens, _, _) in answers.items():
        matcher = engine.grammars.compile(GRAMMARS[name]).new_matcher()
        for position, token_id in enumerate(tokens):
            forced = matcher.compute_ff_tokens()
            logits = torch.zeros(1, engine.vocab_size)
            masker.apply(logits, [matcher])
            allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
            if forced:
                assert allowed == [forced[0]] == [token_id]
                num_forced += position > 0  # the first token is the prompt step's to sample
            assert token_id in allowed
            assert matcher.consume_token(token_id)
    assert num_forced == engine.num_forced_tokens > 0


@pytest.mark.parametrize(
    "overrides",
    [
        {"logprobs": 3},  # each token's logprobs come from its own step
        {"temperature": 0.8, "seed": 7},  # a seeded generator draws once per token
    ],
    ids=["logprobs", "seeded"],
)
def test_requests_that_need_each_step_take_one_step_each(
    tiny_llama_path: Path, overrides: dict[str, Any]
) -> None:
    requests = {name: _greedy(grammar, **overrides) for name, grammar in GRAMMARS.items()}
    off, on = _engine(tiny_llama_path, False), _engine(tiny_llama_path, True)
    assert _run(on, requests) == _run(off, requests)
    assert on.num_forced_tokens == 0


def test_a_stop_string_inside_a_forced_run_ends_the_answer_where_steps_would(
    tiny_llama_path: Path,
) -> None:
    """Stop strings that forced runs pass ("intent" inside the schema's `{"intent":"`,
    "der" inside the regex's "order-"): the answer ends at the token that completes one,
    with the tokens and counts one step a token gives."""
    requests = {
        name: _greedy(grammar, stop=["intent", "der"]) for name, grammar in GRAMMARS.items()
    }
    off, on = _engine(tiny_llama_path, False), _engine(tiny_llama_path, True)
    answers = _run(on, requests)
    assert answers == _run(off, requests)
    assert on.num_forced_tokens > 0
    assert len(answers["schema"][0]) < len(_run(off, {"s": _greedy(GRAMMARS["schema"])})["s"][0])


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8])
def test_the_length_limit_cuts_a_forced_run_where_steps_would(
    tiny_llama_path: Path, max_tokens: int
) -> None:
    requests = {"schema": _greedy(GRAMMARS["schema"], max_tokens=max_tokens)}
    off, on = _engine(tiny_llama_path, False), _engine(tiny_llama_path, True)
    answer = _run(on, requests)
    assert answer == _run(off, requests)
    assert len(answer["schema"][0]) == max_tokens and answer["schema"][1] == "length"


def test_prompt_logprobs_come_with_a_first_output_that_holds_forced_tokens(
    tiny_llama_path: Path,
) -> None:
    engine = _engine(tiny_llama_path, True)
    ids = engine.tokenizer.encode(PROMPT)
    engine.add_request("r", ids, _greedy(GRAMMARS["schema"], prompt_logprobs=2))
    first = next(out for out in engine.step() if out.request_id == "r")
    assert len(first.token_ids) > 1  # `{"` sampled, `intent":"` forced after it
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(ids)
    while engine.has_unfinished_requests():
        assert all(out.prompt_logprobs is None for out in engine.step())


def test_preempted_with_forced_tokens_in_flight(tiny_llama_path: Path) -> None:
    """A pool too small for four answers at once: sequences holding uncomputed forced tokens
    are preempted and recomputed, and each answer is still its answer alone."""
    params = _greedy(GRAMMARS["schema"], max_tokens=60, ignore_eos=True)
    alone = _run(_engine(tiny_llama_path, False), {"a": params})["a"]
    small = _engine(tiny_llama_path, True, num_kv_blocks=24, max_model_len=96)
    answers = _run(small, {str(i): params for i in range(4)})
    assert small.scheduler.num_preemptions > 0 and small.num_forced_tokens > 0
    assert list(answers.values()) == [alone] * 4


def test_a_grammar_completed_by_forced_tokens_finishes_without_another_step(
    tiny_llama_path: Path,
) -> None:
    """A single choice: its first token is sampled at the prompt's step, the rest forced
    after it completes the grammar, and the request ends with that output."""
    grammar = GrammarSpec.choice(["refund_request_now"])
    engine = _engine(tiny_llama_path, True)
    answers = _run(engine, {"r": _greedy(grammar)})
    tokens, finish, _ = answers["r"]
    assert engine.tokenizer.decode(tokens) == "refund_request_now" and finish == "stop"
    assert engine.num_forced_tokens == len(tokens) - 1 >= 2 and engine.num_steps == 1
