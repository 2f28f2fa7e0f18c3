"""Prompt logprobs (the completions API's `echo` with `logprobs`): every prompt token after the
first scored exactly as transformers' forward scores it, across chunks, with no shared
prefix, and `max_tokens=0` to score without generating."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import InvalidRequestError, SamplingParams
from tests.helpers import assert_all_free, tiny_engine

PROMPT = "Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 appear in text too, and the model reads them."


def _hf_prompt_logprobs(path: Path, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]  # [len(ids), vocab]
    return torch.log_softmax(logits, dim=-1)


def _run(engine: Any, ids: list[int], params: SamplingParams) -> Any:
    engine.add_request("r", ids, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    engine.check_integrity()  # and every block not pinned by a registry prefix is free again
    assert engine.pool.num_free_blocks == engine.pool.num_blocks - engine.pool.num_pinned_blocks
    return outputs


@pytest.mark.parametrize("budget", [64, 7])  # the whole prompt in one chunk, or in many
def test_prompt_logprobs_equal_transformers(tiny_llama_path: Path, budget: int) -> None:
    engine = tiny_engine(tiny_llama_path, max_num_batched_tokens=budget)
    ids = engine.tokenizer.encode(PROMPT)
    outputs = _run(engine, ids, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2))
    scored = outputs[0].prompt_logprobs
    assert [o.prompt_logprobs is None for o in outputs] == [False] + [True] * (len(outputs) - 1)
    assert len(scored) == len(ids) and scored[0] is None
    expected = _hf_prompt_logprobs(tiny_llama_path, ids)
    for position, sample in enumerate(scored[1:]):
        row = expected[position]  # position p's logits score token p + 1
        assert sample.token_id == ids[position + 1]
        assert sample.logprob == pytest.approx(float(row[ids[position + 1]]), abs=1e-4)
        assert [t.token_id for t in sample.top] == row.topk(2).indices.tolist()


def test_max_tokens_0_scores_without_generating(tiny_llama_path: Path) -> None:
    engine = tiny_engine(tiny_llama_path)
    ids = engine.tokenizer.encode(PROMPT)
    [output] = _run(engine, ids, SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert (output.token_ids, output.text, output.finish_reason) == ([], "", "length")
    assert output.num_completion_tokens == 0
    assert len(output.prompt_logprobs) == len(ids)
    assert all(s.top == () for s in output.prompt_logprobs[1:])


def test_a_prompt_that_fills_the_context_is_scored_and_one_more_token_is_not(
    tiny_llama_path: Path,
) -> None:
    """Scoring generates nothing, so a prompt of max_model_len tokens fits; one token more,
    or the same prompt with a token to generate, does not."""
    engine = tiny_engine(tiny_llama_path, max_model_len=64)
    ids = (engine.tokenizer.encode(PROMPT) * 8)[:64]
    [output] = _run(engine, ids, SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert len(output.prompt_logprobs) == 64 and output.token_ids == []
    for too_long, params in (
        (ids + ids[:1], SamplingParams(max_tokens=0, prompt_logprobs=0)),
        (ids, SamplingParams(max_tokens=1, prompt_logprobs=0)),
        (ids, SamplingParams()),
    ):
        with pytest.raises(InvalidRequestError, match="maximum context length is 64"):
            engine.add_request("too-long", too_long, params)


def test_max_tokens_0_needs_prompt_logprobs() -> None:
    with pytest.raises(InvalidRequestError) as raised:
        SamplingParams(max_tokens=0)
    assert raised.value.param == "max_tokens"


def test_a_scored_prompt_shares_no_registry_prefix(tiny_llama_path: Path, tmp_path: Path) -> None:
    prefix_file = tmp_path / "prefixes.yaml"
    prefix_file.write_text('version: 1\nprefixes:\n  - name: n\n    text: "Numbers like 0 1 2"\n')
    engine = tiny_engine(tiny_llama_path, prefix_file=str(prefix_file))
    ids = engine.tokenizer.encode(PROMPT)
    plain = _run(engine, ids, SamplingParams(max_tokens=1))
    scored = _run(engine, ids, SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert plain[0].num_cached_tokens > 0
    assert scored[0].num_cached_tokens == 0
    assert len(scored[0].prompt_logprobs) == len(ids)


def test_preemption_does_not_score_a_token_twice(tiny_llama_path: Path) -> None:
    engine = tiny_engine(tiny_llama_path, num_kv_blocks=24, max_model_len=96)
    ids = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, prompt_logprobs=0)
    for i in range(3):
        engine.add_request(str(i), ids, params)
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.prompt_logprobs is not None:
                assert output.request_id not in final  # once, however often it recomputed
                final[output.request_id] = output.prompt_logprobs
    assert engine.scheduler.num_preemptions > 0
    assert_all_free(engine)
    alone = _run(tiny_engine(tiny_llama_path), ids, params)[0].prompt_logprobs
    for scored in final.values():
        assert [s.token_id if s else None for s in scored] == [None, *ids[1:]]
        assert [s.logprob for s in scored[1:]] == pytest.approx(
            [s.logprob for s in alone[1:]], abs=1e-4
        )
