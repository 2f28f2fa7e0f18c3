"""Speculative decoding in the engine, on the tiny Llama as the default model is served (int4
layers, int8 head, the attention kernel: a position's logits have the same bits in any
chunk). Greedy tokens are those of the engine without drafts whatever the schedule; rejected
drafts leave nothing behind; requests that may not take drafts get none."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from engine import LLMEngine, SamplingParams
from engine.core.sampling_params import GrammarSpec
from engine.core.sequence import Sequence
from tests.engine.structured import test_fast_forward
from tests.helpers import assert_all_free, run_staggered, tiny_engine, tokens_of

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _engine(path: Path, **overrides: Any) -> LLMEngine:
    """Every draft taken: the step cost model never counts as fitted, so what these tests
    see does not hang on this machine's timings (tests/engine/speculative/
    test_draft_scheduling.py tests the choice itself)."""
    engine = tiny_engine(path, quantization="int4", **overrides)
    engine.scheduler.pacing.cost.min_observations = 2**62
    return engine


def _prompts(vocab: int) -> list[list[int]]:
    """Prompts that repeat runs of themselves (drafts find them) and plain random ones."""
    rng = random.Random(3)
    prompts = []
    for n in (6, 9, 14):
        run = [rng.randrange(3, vocab) for _ in range(n)]
        prompts.append(run * 3 + run[: n // 2])
    prompts += [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 31, 70)]
    base = prompts[1]
    prompts.append(base + [rng.randrange(3, vocab) for _ in range(4)])  # shares its start
    return prompts


def _lone_answers(path: Path, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    engine = _engine(path, speculative="off", enable_prefix_cache=False)
    answers = [tokens_of(run_staggered(engine, [p], params, [0])[0]) for p in prompts]
    assert engine.scheduler.num_draft_tokens == 0
    return answers


def test_greedy_tokens_equal_the_engine_without_drafts_in_every_schedule(
    tiny_llama_path: Path,
) -> None:
    probe = _engine(tiny_llama_path)
    prompts = _prompts(probe.vocab_size)
    want = _lone_answers(tiny_llama_path, prompts, GREEDY)
    rng = random.Random(5)
    for overrides in (
        {},  # alone, one by one: drafts at every step the cost model allows
        {"max_num_batched_tokens": 12},  # prompt chunks first, drafts in what is left
        {"max_num_batched_tokens": 128},
        {"num_kv_blocks": 40, "max_model_len": 96},  # preempted, some mid-verification
    ):
        engine = _engine(tiny_llama_path, **overrides)
        for _ in range(2):  # the second round hits what the first cached, answers included
            arrivals = [rng.randint(0, 6) for _ in prompts]
            got = [tokens_of(r) for r in run_staggered(engine, prompts, GREEDY, arrivals)]
            assert got == want, overrides
            # n > 1: copies in the same step share the leader's prefill, then draft apart
            copies = run_staggered(engine, [prompts[0]] * 3, GREEDY, [0, 0, 0])
            assert [tokens_of(r) for r in copies] == [want[0]] * 3, overrides
        assert engine.scheduler.num_draft_tokens > 0, overrides
        assert engine.num_accepted_draft_tokens > 0, overrides
        if "num_kv_blocks" in overrides:
            assert engine.scheduler.num_preemptions > 0
        assert_all_free(engine)


def test_rejected_drafts_leave_no_trace_in_the_cache(
    tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every draft wrong: the answers are the same, the blocks balance after every step
    (debug_check_integrity), and a prompt that extends an answer starts from its cached
    blocks and gets the answer it gets with nothing cached (the K/V of rejected drafts, past
    each sequence's computed tokens, was overwritten before any block was indexed)."""
    engine = _engine(tiny_llama_path)
    vocab = engine.vocab_size
    prompts = _prompts(vocab)
    want = _lone_answers(tiny_llama_path, prompts, GREEDY)

    def wrong(seq: Sequence, bar: float = 0.0) -> None:
        seq.draft_token_ids = [(t + 1) % vocab for t in seq.token_ids[-4:]]

    monkeypatch.setattr(engine.drafter, "propose", wrong)
    got = [tokens_of(r) for r in run_staggered(engine, prompts, GREEDY, [0, 1, 1, 2, 2, 3, 3])]
    assert got == want
    drafted = engine.scheduler.num_draft_tokens
    assert drafted > 0 and engine.num_accepted_draft_tokens < drafted / 4
    assert_all_free(engine)

    longer = [p + a for p, a in zip(prompts, want, strict=True)]
    cached = run_staggered(engine, longer, GREEDY, [0] * len(longer))
    assert all(r[-1].num_cached_tokens > 0 for r in cached)
    assert [tokens_of(r) for r in cached] == _lone_answers(tiny_llama_path, longer, GREEDY)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.1),
        SamplingParams(temperature=0.7, seed=3, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, speculative=False),
    ],
    ids=["penalty", "seeded", "opt-out"],
)
def test_requests_that_may_not_take_drafts_get_none(
    tiny_llama_path: Path, params: SamplingParams
) -> None:
    engine = _engine(tiny_llama_path)
    prompts = _prompts(engine.vocab_size)[:3]
    run_staggered(engine, prompts, params, [0, 0, 0])
    assert engine.scheduler.num_draft_tokens == 0
    run_staggered(engine, prompts, GREEDY, [0, 0, 0])  # the same prompts do take drafts
    assert engine.scheduler.num_draft_tokens > 0
    assert_all_free(engine)


def test_a_stop_string_inside_a_kept_run_ends_the_answer_where_steps_would(
    tiny_llama_path: Path,
) -> None:
    """Each request asked again, stopping on a piece of its earlier answer's text: drafted
    from that answer, a kept run carries it past the stop in one step, and the answer still
    ends at the token that completes the stop, with the tokens, text, logprobs and count
    one step a token gives."""
    prompts = _prompts(_engine(tiny_llama_path).vocab_size)
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    engine = _engine(tiny_llama_path)
    requests = []
    for i, outputs in enumerate(run_staggered(engine, prompts, free, [0] * len(prompts))):
        text = "".join(o.text for o in outputs)
        starts = [sum(len(o.text) for o in outputs[:k]) for k in range(len(outputs))]
        spans = [a + b for a, o in zip(starts, outputs, strict=True) for b in o.offsets()]
        assert len(spans) == 24  # where each token's text starts in the answer
        stop = text[spans[4] : spans[11]]
        if stop and text.find(stop) == spans[4]:
            requests.append((f"s{i}", prompts[i], replace(free, stop=(stop,))))
    assert len(requests) >= 3
    off = _engine(tiny_llama_path, speculative="off")
    want = {rid: _outputs(off, [(rid, p, params)])[rid] for rid, p, params in requests}
    accepted = engine.num_accepted_draft_tokens
    got = _outputs(engine, requests)
    for rid, expected in want.items():
        outputs = got[rid]
        assert tokens_of(outputs) == tokens_of(expected)
        assert _logprobs(outputs) == pytest.approx(_logprobs(expected), abs=1e-4)
        assert "".join(o.text for o in outputs) == "".join(o.text for o in expected)
        assert outputs[-1].num_completion_tokens == len(tokens_of(expected))
        assert outputs[-1].stop_reason == expected[-1].stop_reason
        assert isinstance(expected[-1].stop_reason, str)
    assert engine.num_accepted_draft_tokens > accepted
    assert_all_free(engine)


def test_constrained_answers_with_drafts_are_the_answers_without(tiny_llama_path: Path) -> None:
    """Requests under a grammar take only drafts it allows (here from their own earlier
    answers: each request is asked twice), and each drafted position's row is masked as its
    own step would mask it: tokens, finish reasons and logprobs are those of the engine
    without drafts, in both rounds, with drafts kept in the second."""
    text = {"type": "string", "maxLength": 40}
    grammars = {
        **test_fast_forward.GRAMMARS,
        "free-text": GrammarSpec.json_schema(
            {"type": "object", "properties": {"a": text, "b": text}, "required": ["a", "b"]}
        ),
    }
    requests = {
        name: SamplingParams(temperature=0, max_tokens=60, grammar=grammar, logprobs=2)
        for name, grammar in grammars.items()
    }
    want = test_fast_forward._run(_engine(tiny_llama_path, speculative="off"), requests)
    engine = _engine(tiny_llama_path)
    for round in ("first", "again"):
        got = test_fast_forward._run(engine, requests)
        for name in requests:
            tokens, finish, logprobs = got[name]
            assert (tokens, finish) == want[name][:2], (round, name)
            assert [lp.logprob for lp in logprobs] == pytest.approx(
                [lp.logprob for lp in want[name][2]], abs=1e-4
            )
    assert engine.num_accepted_draft_tokens > 0
    assert_all_free(engine)


def _outputs(
    engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]
) -> dict[str, list[Any]]:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list[Any]] = {rid: [] for rid, *_ in requests}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id].append(output)
    return outputs


def _logprobs(outputs: list[Any]) -> list[float]:
    return [lp.logprob for o in outputs for lp in o.logprobs or []]


def test_logprobs_with_drafts_are_the_logprobs_without(tiny_llama_path: Path) -> None:
    """Each kept token's logprobs come from its own position's row: bit for bit those of
    one step a token, alone and among other requests."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    off = _engine(tiny_llama_path, speculative="off")
    on = _engine(tiny_llama_path)
    prompts = _prompts(on.vocab_size)

    def answers(engine: LLMEngine, arrivals: list[int]) -> list[list[tuple[int, Any]]]:
        """Each request's (token, its logprobs) in order: one logprobs entry per token."""
        runs = run_staggered(engine, prompts, params, arrivals)
        return [
            [(t, lp) for o in r for t, lp in zip(o.token_ids, o.logprobs or [], strict=True)]
            for r in runs
        ]

    want = answers(off, [0] * len(prompts))
    assert answers(on, [0] * len(prompts)) == want
    assert answers(on, [3, 0, 1, 2, 0, 5, 1]) == want
    assert on.num_accepted_draft_tokens > 0
    assert_all_free(on)


def test_max_tokens_and_the_context_end_where_they_would_without_drafts(
    tiny_llama_path: Path,
) -> None:
    engine = _engine(tiny_llama_path, max_model_len=64)
    prompt = _prompts(engine.vocab_size)[0]  # 31 tokens that repeat
    for max_tokens in (1, 2, 3, 5, 8, 13):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        [outputs] = run_staggered(engine, [prompt], params, [0])
        assert len(tokens_of(outputs)) == max_tokens
        assert outputs[-1].finish_reason == "length"
        assert outputs[-1].num_completion_tokens == max_tokens
    unbounded = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    [outputs] = run_staggered(engine, [prompt], unbounded, [0])
    assert len(prompt) + len(tokens_of(outputs)) == 64
    assert engine.num_accepted_draft_tokens > 0
    assert_all_free(engine)


def test_no_drafts_where_the_compute_path_is_not_batch_invariant(tiny_llama_path: Path) -> None:
    # Without the C++ kernels the int4 weights run on dense copies through oneDNN, whose
    # results may change with the batch's shape: a draft could then keep a token the
    # one-step path would not have chosen
    engine = _engine(tiny_llama_path, enable_compile=False)
    assert not engine.speculative
    run_staggered(engine, _prompts(engine.vocab_size)[:3], GREEDY, [0, 0, 0])
    assert engine.scheduler.num_draft_tokens == 0
    assert _engine(tiny_llama_path).speculative
