"""Sampled requests with drafts: each token is drawn from the distribution one step a token
draws it from (a draft kept with the probability the model gives it, a rejected one replaced
by a draw from the rest). A chi-square test over many samples on the tiny Llama compares
the joint distribution of the first tokens with drafts (every draft verified, half of them
wrong) and without."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from engine import LLMEngine, SamplingParams
from engine.core.sequence import Sequence
from tests.helpers import assert_all_free, tiny_engine

PARAMS = SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True)
NUM_SAMPLES = 1500
# chi-square with 26 degrees of freedom (27 cells: 3 x 3 x 3 first tokens), p = 0.001
CRITICAL = 54.05


def _engine(path: Path, **overrides: object) -> LLMEngine:
    engine = tiny_engine(
        path, quantization="int4", max_num_seqs=64, max_num_batched_tokens=1024, **overrides
    )
    engine.scheduler.pacing.cost.min_observations = 2**62  # every draft taken
    return engine


def _first_tokens(engine: LLMEngine, prompt: list[int]) -> Counter[tuple[int, ...]]:
    outputs = engine.generate([prompt] * NUM_SAMPLES, PARAMS)
    assert_all_free(engine)
    return Counter(tuple(out[:3]) for out in outputs)


def _chi_square(a: Counter[tuple[int, ...]], b: Counter[tuple[int, ...]]) -> float:
    cells = set(a) | set(b)
    return sum((a[c] - b[c]) ** 2 / (a[c] + b[c]) for c in cells)


def test_sampled_tokens_with_drafts_follow_the_distribution_without(
    tiny_llama_path: Path,
) -> None:
    torch.manual_seed(0)
    off = _engine(tiny_llama_path, speculative="off")
    prompt = [5, 9, 13, 21, 34, 55, 89, 144]
    without = _first_tokens(off, prompt)
    assert len(without) >= 20  # the 27 cells are all likely enough to show up
    # Drafts for the 2nd and 3rd tokens: the likeliest path's, and a token no sample shows
    likely = max(without, key=lambda c: without[c])
    unseen = next(t for t in range(3, 200) if all(t not in c for c in without))
    on = _engine(tiny_llama_path)

    def propose(seq: Sequence, bar: float = 0.0) -> None:
        wrong = seq.num_output_tokens % 2 == 0 or seq.request_id.endswith(("1", "3"))
        draft = [unseen, likely[2]] if wrong else [likely[1], likely[2]]
        seq.draft_token_ids = draft[: PARAMS.max_tokens - seq.num_output_tokens - 1]

    on.drafter.propose = propose  # type: ignore[method-assign]
    with_drafts = _first_tokens(on, prompt)
    drafted, accepted = on.scheduler.num_draft_tokens, on.num_accepted_draft_tokens
    assert drafted >= NUM_SAMPLES and 0 < accepted < drafted / 2
    assert unseen not in {t for c in with_drafts for t in c}  # a zero-probability draft never stays
    statistic = _chi_square(with_drafts, without)
    assert statistic < CRITICAL, (statistic, with_drafts.most_common(5), without.most_common(5))
