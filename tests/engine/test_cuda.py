"""The engine on CUDA: same greedy tokens as on the CPU (skipped without a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, text_prompt_ids

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_generates_like_cpu(tiny_llama_path: Path, tiny_tokenizer: object, dtype: str) -> None:
    """fp32: identical greedy tokens. bf16: kernels round differently, so only the first
    token (largest logit margin) and the lengths must agree."""
    prompts = [text_prompt_ids(tiny_tokenizer, t) for t in ("The quick brown fox", "Hello")]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(device: str) -> list[list[int]]:
        engine = LLMEngine(
            EngineConfig(
                model=str(tiny_llama_path),
                device=device,
                dtype=dtype,
                block_size=4,
                num_kv_blocks=256,
                debug_check_integrity=True,
            )
        )
        return engine.generate(prompts, params)

    cuda, cpu = run("cuda"), run("cpu")
    if dtype == "float32":
        assert cuda == cpu
    else:
        assert [len(t) for t in cuda] == [len(t) for t in cpu] == [12, 12]
        assert [t[0] for t in cuda] == [t[0] for t in cpu]
