"""Same request, same answer, on the tiny Llama as the default model is served (int4 layers
and int8 head on the quantized kernel, the attention kernel; float32 compute, float16 and
float32 KV): each request answered alone, then among others, in chunks of several sizes,
from the automatic cache, as a second copy in the same step, and preempted; tokens and
logprobs bit-identical, greedy and seeded. A random tiny model is full of near-ties, so one
differing bit anywhere shows up as a different token or logprob.

The real model's version of this is tests/e2e/test_smollm2_invariance.py."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from engine import LLMEngine, SamplingParams
from engine.core.outputs import SampleLogprobs
from tests.helpers import assert_all_free, tiny_engine

MAX_TOKENS = 12
Answer = tuple[tuple[int, ...], tuple[SampleLogprobs, ...]]


def _params(i: int) -> SamplingParams:
    """Even requests greedy (every other one with all three penalties, whose counts are kept
    between steps), odd ones seeded at temperature 0.9."""
    if i % 4 == 2:
        return SamplingParams(
            temperature=0,
            max_tokens=MAX_TOKENS,
            logprobs=2,
            ignore_eos=True,
            repetition_penalty=1.3,
            frequency_penalty=0.4,
            presence_penalty=0.2,
        )
    if i % 2 == 0:
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True)
    return SamplingParams(
        temperature=0.9, seed=i, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True
    )


def _prompts(vocab: int) -> list[list[int]]:
    """Short and long (past one 128-token attention chunk), some sharing long prefixes."""
    rng = random.Random(0)
    base = [rng.randrange(3, vocab) for _ in range(200)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 17, 64, 129, 250)]
    prompts += [base[:n] + [rng.randrange(3, vocab) for _ in range(5)] for n in (40, 133, 190)]
    return prompts


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], int]]) -> dict[str, Answer]:
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    logprobs: dict[str, list[SampleLogprobs]] = {rid: [] for rid, _, _ in requests}
    last = max(arrival for *_, arrival in requests)
    step = 0
    while step <= last or engine.has_unfinished_requests():
        for rid, prompt, arrival in requests:
            if arrival == step:
                engine.add_request(rid, prompt, _params(int(rid.split(".")[0])))
        for output in engine.step():
            tokens[output.request_id] += output.token_ids
            logprobs[output.request_id] += output.logprobs or []
        step += 1
    engine.check_integrity()
    return {rid: (tuple(tokens[rid]), tuple(logprobs[rid])) for rid in tokens}


def _engine(path: Path, kv: str, **overrides: Any) -> LLMEngine:
    return tiny_engine(path, quantization="int4", kv_cache_dtype=kv, **overrides)


@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_every_answer_is_the_lone_answer_whatever_else_runs(tiny_llama_path: Path, kv: str) -> None:
    alone_engine = _engine(tiny_llama_path, kv, enable_prefix_cache=False)
    assert alone_engine.runner.use_cpu_kernels
    prompts = _prompts(alone_engine.vocab_size)
    alone: dict[str, Answer] = {}
    for i, prompt in enumerate(prompts):
        alone.update(_run(alone_engine, [(str(i), prompt, 0)]))
    assert_all_free(alone_engine)
    rng = random.Random(1)
    for overrides in (
        {},  # the default 64-token steps, automatic cache on
        {"max_num_batched_tokens": 7},
        {"max_num_batched_tokens": 128},
        {"max_itl_ms": 1e-3},  # pacing: a block of prompt per step beside decodes
        {"num_kv_blocks": 100, "max_model_len": 300},  # ~1.5 longest requests: preemption
    ):
        engine = _engine(tiny_llama_path, kv, **overrides)
        for _ in range(2):  # the second round starts from what the first one cached
            requests = [
                (f"{i}.{copy}", prompt, rng.randint(0, 12))
                for i, prompt in enumerate(prompts)
                for copy in range(2 if i % 3 == 0 else 1)  # n > 1: a second copy
            ]
            rng.shuffle(requests)
            answers = _run(engine, requests)
            differ = [rid for rid, answer in answers.items() if answer != alone[rid.split(".")[0]]]
            assert not differ, f"{overrides}: {differ} differ from their lone answers"
        if "num_kv_blocks" in overrides:
            assert engine.scheduler.num_preemptions > 0
        if "max_itl_ms" in overrides:
            assert engine.scheduler.pacing.num_cut_chunks > 0
