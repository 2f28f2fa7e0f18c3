"""LLMEngine on the tiny models: exact greedy equality with transformers, stops, aborts, leaks."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import (
    GrammarSpec,
    InvalidRequestError,
    LLMEngine,
    PromptTooLongError,
    SamplingParams,
)
from tests.helpers import assert_all_free as _assert_all_free
from tests.helpers import run_staggered, tiny_engine, tokens_of

GREEDY_FIELDS: dict[str, Any] = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
GREEDY = SamplingParams(**GREEDY_FIELDS)
PROMPTS = [
    "The quick brown fox",
    "A paged key-value cache stores attention keys",
    "Hello",
    "Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 appear in text too, and the model reads them.",
]


_engine = tiny_engine


def _hf_greedy(
    path: Path, prompt: list[int], max_new_tokens: int, bias: dict[int, float] | None = None
) -> list[int]:
    """Plain argmax over transformers' own forward, of its logits plus `bias` (token id ->
    value). (`generate` would treat EOS specially, and a random tiny model emits EOS often;
    the real-model tests in tests/e2e use `generate` itself.)"""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            for token_id, value in (bias or {}).items():
                logits[token_id] += value
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model_path(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}_path")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer: Any) -> list[list[int]]:
    return [tiny_tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(model_path: Path, prompts: list[list[int]]) -> list[list[int]]:
    return [_hf_greedy(model_path, p, GREEDY.max_tokens or 0) for p in prompts]


def test_greedy_matches_transformers_one_at_a_time(
    model_path: Path, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    engine = _engine(model_path)
    for prompt, want in zip(prompts, expected, strict=True):
        assert engine.generate([prompt], GREEDY) == [want]
    _assert_all_free(engine)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="continuous-batch"),
        pytest.param({"max_num_batched_tokens": 5}, id="chunked-prefill-5"),
        pytest.param({"num_kv_blocks": 14, "max_model_len": 48}, id="preemption"),
        pytest.param({"max_num_seqs": 2}, id="two-slots"),
    ],
)
def test_greedy_matches_transformers_in_a_staggered_batch(
    model_path: Path,
    prompts: list[list[int]],
    expected: list[list[int]],
    overrides: dict[str, Any],
) -> None:
    engine = _engine(model_path, **overrides)
    results = run_staggered(engine, prompts, GREEDY, arrivals=[0, 0, 2, 5])
    assert [tokens_of(r) for r in results] == expected
    assert [r[-1].finish_reason for r in results] == ["length"] * 4
    if "num_kv_blocks" in overrides:
        assert engine.scheduler.num_preemptions > 0
    _assert_all_free(engine)


def test_logit_bias_moves_greedy_as_transformers_says(
    tiny_llama_path: Path, prompts: list[list[int]]
) -> None:
    """Each prompt's greedy answer with its first token banned and another favoured, as
    transformers' argmax of the logits plus the bias gives it, among unbiased requests in
    a staggered batch that keep their own answers. (Drafted positions, which float32 weights
    never take: tests/e2e/test_smollm2_invariance.py.)"""
    engine = _engine(tiny_llama_path)
    plain = [_hf_greedy(tiny_llama_path, p, 12) for p in prompts]
    biases = [{answer[0]: -100.0, 7 + i: 2.5} for i, answer in enumerate(plain)]
    biased = [_hf_greedy(tiny_llama_path, p, 12, b) for p, b in zip(prompts, biases, strict=True)]
    assert all(b[0] != a[0] for a, b in zip(plain, biased, strict=True))
    requests = [
        (f"b{i}", SamplingParams(**GREEDY_FIELDS, logit_bias=tuple(bias.items())))
        for i, bias in enumerate(biases)
    ] + [(f"p{i}", GREEDY) for i in range(len(prompts))]
    outputs: dict[str, list[int]] = {rid: [] for rid, _ in requests}
    for step in range(200):
        if step < len(requests):  # one arrival a step: every mix of biased and plain rows
            rid, params = requests[step]
            engine.add_request(rid, prompts[int(rid[1:])], params)
        for output in engine.step():
            outputs[output.request_id] += output.token_ids
        if step >= len(requests) and not engine.has_unfinished_requests():
            break
    assert [outputs[f"b{i}"] for i in range(len(prompts))] == biased
    assert [outputs[f"p{i}"] for i in range(len(prompts))] == plain
    _assert_all_free(engine)


def test_outputs_carry_exact_counts(tiny_llama_path: Path, prompts: list[list[int]]) -> None:
    engine = _engine(tiny_llama_path)
    [outputs] = run_staggered(engine, prompts[:1], GREEDY, [0])
    # Each delta's count is every token delivered so far (a step may deliver several:
    # accepted draft tokens)
    delivered = list(itertools.accumulate(len(o.token_ids) for o in outputs))
    assert [o.num_completion_tokens for o in outputs] == delivered
    assert delivered[-1] == 12
    assert {o.num_prompt_tokens for o in outputs} == {len(prompts[0])}
    assert {o.num_cached_tokens for o in outputs} == {0}
    assert [o.finish_reason for o in outputs] == [None] * (len(outputs) - 1) + ["length"]


def test_seeded_sampling_is_reproducible_and_batch_independent(
    tiny_llama_path: Path, prompts: list[list[int]]
) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = _engine(tiny_llama_path).generate([prompts[0]], seeded)[0]
    engine = _engine(tiny_llama_path)
    together = engine.generate([prompts[1], prompts[0], prompts[2]], seeded)
    assert together[1] == alone
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True)
    assert engine.generate([prompts[0]], other_seed)[0] != alone


def test_stop_string_ends_the_request_and_never_leaks(
    tiny_llama_path: Path, prompts: list[list[int]], tiny_tokenizer: Any
) -> None:
    engine = _engine(tiny_llama_path)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    [full] = run_staggered(engine, prompts[:1], params, [0])
    text = "".join(o.text for o in full)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    [stopped] = run_staggered(
        engine,
        prompts[:1],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=(stop,)),
        [0],
    )
    got = "".join(o.text for o in stopped)
    assert got == text[: text.index(stop)]
    assert (stopped[-1].finish_reason, stopped[-1].stop_reason) == ("stop", stop)
    _assert_all_free(engine)


def test_stop_token_id_ends_the_request(tiny_llama_path: Path, prompts: list[list[int]]) -> None:
    engine = _engine(tiny_llama_path)
    [full] = engine.generate([prompts[0]], GREEDY)
    stop_id = full[3]
    first = full.index(stop_id)
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=(stop_id,)
    )
    [outputs] = run_staggered(engine, prompts[:1], params, [0])
    assert tokens_of(outputs) == full[: first + 1]
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", stop_id)


def test_max_model_len_ends_generation_with_length(
    tiny_llama_path: Path, prompts: list[list[int]]
) -> None:
    engine = _engine(tiny_llama_path, max_model_len=24)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    [outputs] = run_staggered(engine, prompts[1:2], params, [0])
    assert outputs[-1].finish_reason == "length"
    assert len(prompts[1]) + outputs[-1].num_completion_tokens == 24


def test_abort_frees_blocks_of_running_and_waiting_requests(
    tiny_llama_path: Path, prompts: list[list[int]]
) -> None:
    engine = _engine(tiny_llama_path, max_num_seqs=1)
    engine.add_request("running", prompts[3], GREEDY)
    engine.add_request("waiting", prompts[1], GREEDY)
    engine.step()
    assert engine.num_running == 1 and engine.num_waiting == 1
    assert engine.pool.num_free_blocks < engine.pool.num_blocks
    for request_id in ("running", "waiting"):
        output = engine.abort_request(request_id)
        assert output is not None and output.finish_reason == "abort"
    assert engine.abort_request("unknown") is None
    assert not engine.has_unfinished_requests()
    _assert_all_free(engine)


@pytest.mark.parametrize(
    ("prompt", "params", "error", "param"),
    [
        ([], GREEDY, InvalidRequestError, "prompt"),
        ([1, 2, 10**6], GREEDY, InvalidRequestError, "prompt"),
        ([-1], GREEDY, InvalidRequestError, "prompt"),
        ([1, 2], SamplingParams(logit_bias=((10**6, 1.0),)), InvalidRequestError, "logit_bias"),
        ([1] * 60, SamplingParams(max_tokens=5), PromptTooLongError, "max_tokens"),
        ([1] * 64, SamplingParams(max_tokens=None), PromptTooLongError, "prompt"),
    ],
)
def test_bad_requests_are_rejected_with_typed_errors(
    tiny_llama_path: Path, prompt: list[int], params: SamplingParams, error: type, param: str
) -> None:
    engine = _engine(tiny_llama_path, max_model_len=64)
    with pytest.raises(error) as info:
        engine.add_request("bad", prompt, params)
    assert info.value.param == param
    assert not engine.has_unfinished_requests()
    _assert_all_free(engine)


def test_prompt_too_long_message_has_the_numbers(tiny_llama_path: Path) -> None:
    engine = _engine(tiny_llama_path, max_model_len=64)
    with pytest.raises(
        PromptTooLongError,
        match="maximum context length is 64 tokens.*65 tokens "
        r"\(60 in the prompt, 5 in the completion\)",
    ):
        engine.add_request("x", [1] * 60, SamplingParams(max_tokens=5))


def test_duplicate_request_id_is_rejected(tiny_llama_path: Path) -> None:
    engine = _engine(tiny_llama_path)
    engine.add_request("a", [1, 2, 3], GREEDY)
    with pytest.raises(InvalidRequestError, match="duplicate"):
        engine.add_request("a", [1, 2, 3], GREEDY)


# -- in-step deduplication: scoped and invisible -------------------------------------------------
def _run_together(engine: LLMEngine, requests: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Add prepared requests together (one admission step); each one's cached tokens."""
    for request_id, request in requests.items():
        engine.add_prepared(request_id, request)
    cached: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            cached[out.request_id] = out.num_cached_tokens
    return {request_id: (cached[request_id],) for request_id in requests}


def test_duplicates_in_one_step_report_no_cached_tokens(
    tiny_llama_path: Path, tiny_tokenizer: Any
) -> None:
    """Two identical prompts in one step are prefilled once, but the second must not learn
    that: its cached_tokens are what it would get alone (0 here, no registry)."""
    engine = _engine(tiny_llama_path)
    prompt = tiny_tokenizer.encode(PROMPTS[3])
    request = engine.prepare_request(prompt, SamplingParams(temperature=0, max_tokens=2))
    start = engine.runner.num_forward_tokens
    cached = _run_together(engine, {"a": request, "b": request})
    assert engine.runner.num_forward_tokens - start == len(prompt) + 2  # one prefill, 2 decodes
    assert cached == {"a": (0,), "b": (0,)}
    _assert_all_free(engine)


def test_duplicates_with_different_cache_salts_are_not_shared(
    tiny_llama_path: Path, tiny_tokenizer: Any
) -> None:
    engine = _engine(tiny_llama_path)
    prompt = tiny_tokenizer.encode(PROMPTS[3])
    params = SamplingParams(temperature=0, max_tokens=1)
    start = engine.runner.num_forward_tokens
    _run_together(
        engine,
        {
            "tenant-a": engine.prepare_request(prompt, params, cache_salt="a"),
            "tenant-b": engine.prepare_request(prompt, params, cache_salt="b"),
            "tenant-a-again": engine.prepare_request(prompt, params, cache_salt="a"),
        },
    )
    # Two prefills (one per salt); the third request shared tenant a's.
    assert engine.runner.num_forward_tokens - start == 2 * len(prompt)
    _assert_all_free(engine)


def test_the_input_batch_gives_back_the_rows_of_finished_requests(tiny_llama_path: Path) -> None:
    """A finished request's block-table row is released by the next step that runs, however
    long the engine was idle in between: many requests never grow the table."""
    engine = tiny_engine(tiny_llama_path)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    batch = engine.runner.input_batch
    num_rows = batch.block_tables.shape[0]
    for round_ in range(3):
        engine.generate([[1 + i, 2, 3 + round_] for i in range(num_rows)], params)
        assert engine.step() == []  # idle: nothing runs, nothing is released yet
    engine.generate([[7, 7, 7]], params)
    assert len(batch._row_of) == 1  # only the last request's row, until the next step
    assert batch.block_tables.shape[0] == num_rows


@pytest.mark.parametrize("with_contract", [False, True])
def test_the_grammar_compiler_is_built_by_the_first_constrained_request(
    tiny_llama_path: Path, tmp_path: Path, with_contract: bool
) -> None:
    """llguidance's view of the tokenizer costs a start 0.3-1 s and up to ~135 MB (Gemma 3's
    262k tokens): a start never builds it, not even for a prefix file whose entry has an
    output contract (checked without the tokenizer, and served under it); the first
    constrained request builds it."""
    entry = '  - name: n\n    text: "Numbers like 0 1 2"\n'
    if with_contract:
        entry += "    response_format: {type: json_object}\n"
    prefix_file = tmp_path / "prefixes.yaml"
    prefix_file.write_text("version: 1\nprefixes:\n" + entry)
    engine = tiny_engine(tiny_llama_path, prefix_file=str(prefix_file))
    assert len(engine.registry.prefixes) == 1
    contract = engine.prefix_contract([*engine.registry.prefixes["n"].token_ids, 5])
    assert (contract is not None and contract.grammar is not None) == with_contract
    assert engine.checker._grammars is None
    plain = SamplingParams(temperature=0, max_tokens=2)
    engine.add_request("plain", [5, 6, 7], plain)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.checker._grammars is None
    constrained = SamplingParams(temperature=0, max_tokens=4, grammar=GrammarSpec.json_schema())
    engine.add_request("json", [5, 6, 7], constrained)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.checker._grammars is not None
